"""What every method on FedTIP's task protocol shares: the settings, the bank and protocol
they attach, the hooks the temporal program reads, the declared Eq. (2) message and its size;
the base of FedTIP and of its baselines (docs/fedtip.md)."""
