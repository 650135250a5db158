"""fedlightning: federated graph learning research on PyTorch Lightning."""

__version__ = "0.1.0"
