"""Typed messages, the communication ledger, the round loop and runners."""

from fedlightning.federation.ledger import CommLedger
from fedlightning.messages import ClientUpdate, ServerBroadcast

__all__ = ["ClientUpdate", "CommLedger", "ServerBroadcast"]
