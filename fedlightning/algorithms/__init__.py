"""Algorithms are wiring: which client module, callbacks and server parts make a method."""

from fedlightning.algorithms.base import Algorithm, FederatedClient
from fedlightning.algorithms.fedavg import FedAvg
from fedlightning.algorithms.fedprox import FedProx

__all__ = ["Algorithm", "FedAvg", "FedProx", "FederatedClient"]
