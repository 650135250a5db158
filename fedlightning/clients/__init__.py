"""Client LightningModules: local training and its losses."""

from fedlightning.clients.losses import proximal_term
from fedlightning.clients.node_classifier import NodeClassifier

__all__ = ["NodeClassifier", "proximal_term"]
