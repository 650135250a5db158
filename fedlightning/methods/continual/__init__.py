"""The class-incremental baselines as switches of one ``ContinualFedAvg`` (FedAvg, +replay,
FedProx+replay, FedLwF, energy+replay) and their retrieval forms; the base of every
class-incremental method (docs/fedogl.md)."""
