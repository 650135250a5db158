"""Algorithms are wiring: which client module, callbacks and server parts make a method."""

from fedlightning.algorithms.fedavg import FedAvg
from fedlightning.algorithms.fedprox import FedProx
from fedlightning.federation.algorithm import Algorithm, FederatedClient

__all__ = ["Algorithm", "FedAvg", "FedProx", "FederatedClient"]
