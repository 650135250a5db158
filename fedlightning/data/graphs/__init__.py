"""Multimodal attributed graphs: the built-in datasets, the folder format and a generator."""

from fedlightning.data.graphs.base import MultimodalGraph, apply_missing
from fedlightning.data.graphs.citeseer_mm import load_citeseer_mm
from fedlightning.data.graphs.folder import load_folder, save_folder
from fedlightning.data.graphs.magb import load_magb
from fedlightning.data.graphs.planetoid import data_root, load_planetoid
from fedlightning.data.graphs.synthetic import make_synthetic

__all__ = [
    "MultimodalGraph",
    "apply_missing",
    "data_root",
    "load_planetoid",
    "load_citeseer_mm",
    "load_folder",
    "load_magb",
    "save_folder",
    "make_synthetic",
]
