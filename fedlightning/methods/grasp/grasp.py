"""GRASP (Ma et al., NeurIPS 2024) in the class-incremental stream (docs/fedogl.md, "GRASP"):
FedAvg + replay, the base score propagated on each client's subgraph, the sign calibrated on
validation; :class:`RetrievalGRASP` propagates the top-1 similarity."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fedlightning.errors import ConfigError
from fedlightning.federation.retrieval_stages import split_scores
from fedlightning.methods.continual.continual import ContinualFedAvg
from fedlightning.methods.continual.retrieval_baselines import ContinualRetrieval
from fedlightning.methods.grasp.grasp_score import grasp_propagate, grasp_selection
from fedlightning.metrics import max_similarity
from fedlightning.metrics.open_set import energy_score, msp_score

BASES = {"msp": msp_score, "energy": energy_score}


class GRASPSettings:
    """What both GRASP readings share (a mixin before their FedAvg base): the validated
    ``tau1``, ``tau2`` in (0, 1], ``steps`` >= 0, ``delta`` >= 0, and the propagation."""

    calibrate_direction = True

    def __init__(
        self, tau1: float = 0.05, tau2: float = 0.5, steps: int = 8, delta: float = 1.02, **kw: Any
    ) -> None:
        for key, v in (("tau1", tau1), ("tau2", tau2)):
            if not 0.0 < float(v) <= 1.0:
                raise ConfigError(f"algorithm.{key}", f"must be in (0, 1], got {v!r}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConfigError("algorithm.steps", f"must be an integer >= 0, got {steps!r}")
        if not float(delta) >= 0:
            raise ConfigError("algorithm.delta", f"must be >= 0, got {delta!r}")
        kw.setdefault("name", "grasp")
        super().__init__(**kw)
        self.tau1, self.tau2 = float(tau1), float(tau2)
        self.steps, self.delta = steps, float(delta)

    def propagate(self, base: Tensor, data: Any, candidates: Tensor, train: Tensor) -> Tensor:
        g = grasp_selection(base, data.edge_index, candidates, train, self.tau1, self.tau2)
        return grasp_propagate(base, data.edge_index, g, self.steps, self.delta)


class GRASP(GRASPSettings, ContinualFedAvg):
    """FedAvg + replay rejecting by GRASP's propagated ``base`` score (``msp`` or ``energy``)."""

    def __init__(self, base: str = "msp", **kw: Any) -> None:
        if base not in BASES:
            raise ConfigError("algorithm.base", f"must be one of {tuple(BASES)}, got {base!r}")
        super().__init__(**kw)
        self.base = base

    def node_score(
        self, logits: Tensor, known: Tensor, data: Any, reps: dict, global_state: dict
    ) -> Tensor:
        base = BASES[self.base](logits, known)
        known_ids = known.bool().nonzero().squeeze(1)
        train = data.train_mask & torch.isin(data.y, known_ids)
        return self.propagate(base, data, data.val_mask | data.test_mask, train)


class RetrievalGRASP(GRASPSettings, ContinualRetrieval):
    """Retrieval rejecting by GRASP's propagated top-1 similarity to the split's known items."""

    @torch.no_grad()
    def query_scores(
        self, net: Any, q: Tensor, k: Tensor, data: Any, is_known: Tensor, global_state: dict
    ) -> Tensor:
        base = split_scores(max_similarity, q, k, is_known & net.pair_mask(data), data)
        candidates = (data.val_mask | data.test_mask) & net.availability(data, net.query)
        return self.propagate(base, data, candidates, data.train_mask & is_known)
