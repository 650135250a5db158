"""STFL (Lou et al., arXiv 2111.06750; docs/fedtip.md, "STFL"): :class:`STFLNet` on a small
graph per event; FedAvg."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from fedlightning.methods.dynamic.dynamic_baselines import DynamicBaseline
from fedlightning.methods.dynamic.dynamic_model import EDGES, STFLNet


def neighbour_inputs(view, nodes: dict[str, Tensor]) -> dict[str, Tensor]:
    """``nb_<side>``: the last window's states of each endpoint's recent neighbours (zeros
    where absent), ``nm_<side>`` their validity."""
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
    """STFL; ``edges``: ``interaction`` or ``knn``."""

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
