"""FedSage+, a FedTIP Table 2 baseline: a NeighGen round, mended graphs, FedAvg SAGE."""
