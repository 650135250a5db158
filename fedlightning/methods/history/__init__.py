"""FedTIP baselines on the pre-training history graph: the one-off exchange, FedAvg of a
GNN fitted on each task's support, scoring; the base of FedGCN and FedSage+."""
