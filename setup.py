"""Packaging beyond pyproject.toml (which holds the metadata): the repository's top-level
``conf/``, the one source of the Hydra configs, ships inside the wheel as the package data
``fedlightning.conf`` (a folder ``conf`` inside the package); fedlightning/resources.py
finds it there, or in ``conf/`` of a source checkout. tests/test_packaging.py builds the
wheel and runs it."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["fedlightning", "fedlightning.*"]), "fedlightning.conf"],
    package_dir={"fedlightning.conf": "conf"},
    package_data={"fedlightning.conf": ["*.yaml", "**/*.yaml"]},
)
