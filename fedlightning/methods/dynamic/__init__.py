"""The dynamic baselines' shared verbs (history snapshot view, stacked fit, FedAvg of the
model): the base of Feddy, STFL and FedDGL (docs/fedtip.md)."""
