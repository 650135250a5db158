"""FedIIH, a FedOGL baseline: disentangled GNN, posterior similarity, factor mixing
(docs/fedogl.md)."""
