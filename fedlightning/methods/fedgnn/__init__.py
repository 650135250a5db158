"""FedGNN, a FedTIP Table 2 baseline: LDP-perturbed embedding rows, pseudo-items, row-sparse
FedAvg (docs/fedtip.md)."""
