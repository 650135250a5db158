"""FedLink, a FedTIP Table 2 baseline: ID embeddings and a heterogeneous GraphSAGE, built
on FedGNN (docs/fedtip.md)."""
