"""FedSSP, a FedOGL baseline: spectral GNN, GSKS uniform mean, PGPA (docs/fedogl.md)."""
