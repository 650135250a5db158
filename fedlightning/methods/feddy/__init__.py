"""Feddy, a FedTIP Table 2 baseline (docs/fedtip.md)."""
