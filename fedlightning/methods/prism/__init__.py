"""PRISM, a FedOGL baseline: retrieval of a missing modality, gate, structural prompt
(docs/fedogl.md, "PRISM")."""
