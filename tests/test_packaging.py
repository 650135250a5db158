"""The wheel is self-contained: built from this checkout, installed into a fresh virtual
environment, its ``fedlightning`` composes every experiment and trains the demo from an
empty directory, with the configs it carries (not the checkout's ``conf/``)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("fedlightning", "conf", "pyproject.toml", "setup.py", "README.md")
HANG_GUARD_S = 600  # far above the normal time (seconds): only a hung build or run trips it


def _run(cmd: list, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert r.returncode == 0, f"{cmd}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    return r


def build_wheel(out: Path) -> Path:
    """The wheel of a clean copy of this checkout (no build files left in the checkout);
    without the build isolation (no download) when setuptools is at hand."""
    src = out / "src"
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", out / "dist", src]
    _run([*cmd, "--disable-pip-version-check", "-q"], cwd=out)
    (wheel,) = (out / "dist").glob("fedlightning-*.whl")
    return wheel


def fresh_env(wheel: Path, where: Path) -> Path:
    """A new virtual environment holding the wheel, that sees this interpreter's packages
    (torch & co.) through a ``.pth`` file written after the install, so that pip neither
    reinstalls them nor touches the ``fedlightning`` installed here; returns its ``bin``."""
    from pip import __version__ as pip_version

    remote = tuple(int(x) for x in pip_version.split(".")[:2]) >= (22, 3)  # pip --python
    _run(
        [sys.executable, "-m", "venv", *(["--without-pip"] if remote else []), where], where.parent
    )
    bindir = where / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / ("python.exe" if os.name == "nt" else "python")
    pip = [sys.executable, "-m", "pip", "--python", python] if remote else [python, "-m", "pip"]
    pip.append("--disable-pip-version-check")
    # --ignore-installed: whatever fedlightning the environment may see already (an editable
    # install, a PYTHONPATH), this one goes into the new environment
    _run([*pip, "install", "--no-deps", "--no-index", "--ignore-installed", "-q", wheel], cwd=where)
    purelib = _run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], where
    )
    installed = Path(purelib.stdout.strip())
    assert (installed / "fedlightning" / "conf").is_dir(), sorted(
        p.name for p in installed.iterdir()
    )
    ours = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    (installed / "_fedlightning_test_deps.pth").write_text("\n".join(ours))
    return bindir


@pytest.mark.slow
def test_wheel_runs_the_demo_from_an_empty_directory(tmp_path):
    wheel = build_wheel(tmp_path / "build")

    # the wheel carries conf/ as fedlightning/conf, file for file
    with zipfile.ZipFile(wheel) as z:
        packed = {
            n.removeprefix("fedlightning/conf/"): z.read(n)
            for n in z.namelist()
            if n.startswith("fedlightning/conf/")
        }
    source = {p.relative_to(REPO / "conf").as_posix(): p for p in (REPO / "conf").rglob("*.yaml")}
    assert "train.yaml" in packed and "experiment/demo.yaml" in packed
    assert sorted(packed) == sorted(source)
    assert all(packed[name] == source[name].read_bytes() for name in source)

    bindir = fresh_env(wheel, tmp_path / "venv")
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env |= {"FEDLIGHTNING_CACHE": str(tmp_path / "cache"), "PYTHONNOUSERSITE": "1"}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'mlflow.db'}"

    # the environment's fedlightning is the wheel's, with its own configs; every
    # experiment of the checkout composes with them
    experiments = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))
    probe = (
        "import sys, fedlightning\n"
        "from fedlightning.config import CONF_DIR, compose\n"
        "print(fedlightning.__file__); print(CONF_DIR)\n"
        "for name in sys.argv[1:]:\n"
        "    assert compose([f'experiment={name}']).name, name\n"
        "print(len(sys.argv) - 1)\n"
    )
    r = _run([bindir / "python", "-c", probe, *experiments], cwd=empty, env=env)
    package, conf, composed = r.stdout.split()
    venv = (tmp_path / "venv").resolve()
    assert Path(package).resolve().is_relative_to(venv), package
    assert Path(conf).resolve() == Path(package).resolve().parent / "conf"
    assert int(composed) == len(experiments) >= 15  # a recipe per protocol and dataset

    r = _run(
        [bindir / "fedlightning", "train", "experiment=demo", "federation.rounds=1"],
        cwd=empty,
        env=env,
    )
    summaries = list((empty / "outputs").glob("*/demo/*/summary.json"))
    assert len(summaries) == 1, r.stdout[-2000:]
    assert str(summaries[0].parent) in r.stdout  # the run's directory, as printed
