"""Server side: global state and aggregation. Never imports Lightning."""

from fedlightning.server.aggregate import fedavg, weighted_average
from fedlightning.server.server import Server, ServerModule

__all__ = ["Server", "ServerModule", "fedavg", "weighted_average"]
