"""fedlightning: federated graph learning research on PyTorch Lightning."""

from fedlightning.utils.lean_imports import install as _install_lean_imports

__version__ = "0.1.0"

# PyG and torchmetrics import without the heavy optional packages they only probe
# (transformers, matplotlib, scipy): fedlightning/utils/lean_imports.py
_install_lean_imports()
