"""STFL (Lou et al., arXiv 2111.06750), a published baseline of FedTIP's Table 2 (docs/fedtip.md,
"STFL"): a small graph per event, its source and target and each one's most recent history
neighbours with their bank states, joined by real interactions (or kNN edges); two
GraphSAGE layers, a readout to the event's score
(:class:`~fedlightning.methods.dynamic.dynamic_model.STFLNet`); FedAvg of the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from fedlightning.methods.dynamic.dynamic_baselines import DynamicBaseline
from fedlightning.methods.dynamic.dynamic_model import EDGES, STFLNet


def neighbour_inputs(view, nodes: dict[str, Tensor]) -> dict[str, Tensor]:
    """``nb_<side>`` ``[n, L, d]``: the bank states (the history's last window) of each
    endpoint's ``L`` most recent history neighbours (zeros where it has fewer), and their
    validity ``nm_<side>`` ``[n, L]``."""
    out = {}
    states = view.states[-1]
    for side, v in nodes.items():
        near = view.recent[v]
        ok = near >= 0
        out[f"nb_{side}"] = states[near.clamp(min=0)] * ok.unsqueeze(-1)
        out[f"nm_{side}"] = ok
    return out


@dataclass
class STFL(DynamicBaseline):
    """STFL (module docstring). ``hidden``: the GraphSAGE width (the paper's 32); ``edges``:
    ``interaction`` or ``knn`` (``knn`` neighbours per node)."""

    name: str = "stfl"
    hidden: int = 32
    edges: str = "interaction"
    knn: int = 3

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.edges not in EDGES:
            raise ValueError(f"algorithm.edges must be one of {EDGES}, got {self.edges!r}")

    def net(self, d_h: int) -> STFLNet:
        return STFLNet(d_h, self.hidden, self.edges, self.knn)

    def event_inputs(self, nodes: dict[str, Tensor]) -> dict[str, Tensor]:
        return neighbour_inputs(self.view, nodes)
