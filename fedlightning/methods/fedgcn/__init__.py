"""FedGCN, a FedTIP Table 2 baseline: neighbour-feature sums exchanged once, FedAvg GCN."""
