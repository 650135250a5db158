"""POWER, a FedOGL baseline: coverage replay, gradient matching and distillation on
server-side pseudo-nodes (docs/fedogl.md, "POWER")."""
