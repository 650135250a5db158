"""GRASP (Ma et al., NeurIPS 2024) in the class-incremental stream, as a composition.

Post-hoc: the backbone is FedAvg with the shared class-balanced replay budget (as
``cil_fedavg_replay``). After every stage each client propagates the global model's base
score (MSP or energy over the known classes) over its own subgraph
(:mod:`fedlightning.methods.grasp.grasp_score`): its candidates are its validation and test nodes, its
training nodes those of the known classes. The sign is calibrated on validation. No extra
communication (docs/fedogl.md, "GRASP").

:class:`RetrievalGRASP` is its retrieval reading (``cir_grasp``): the base score is each
query's top-1 cross-modal similarity against its split's known-class items.
"""

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


def check_grasp(tau1: float, tau2: float, steps: int, delta: float) -> None:
    """GRASP's hyperparameters: ``tau1``, ``tau2`` in (0, 1], ``steps`` >= 0, ``delta`` >= 0."""
    for key, v in (("tau1", tau1), ("tau2", tau2)):
        if not 0.0 < float(v) <= 1.0:
            raise ConfigError(f"algorithm.{key}", f"must be in (0, 1], got {v!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError("algorithm.steps", f"must be an integer >= 0, got {steps!r}")
    if not float(delta) >= 0:
        raise ConfigError("algorithm.delta", f"must be >= 0, got {delta!r}")


class GRASP(ContinualFedAvg):
    """FedAvg + replay whose rejection score is GRASP's propagated base score.

    Args:
        base: the propagated score, ``msp`` (default) or ``energy``.
        tau1: fraction of candidates predicted known (and unknown), default ``0.05``.
        tau2: fraction of training nodes in :math:`G`, default ``0.5``.
        steps: propagation steps ``K``, default ``8``.
        delta: weight of :math:`G`'s added edges, default ``1.02``.
        **kw: as :class:`~fedlightning.methods.continual.continual.ContinualFedAvg`.
    """

    calibrate_direction = True

    def __init__(
        self,
        base: str = "msp",
        tau1: float = 0.05,
        tau2: float = 0.5,
        steps: int = 8,
        delta: float = 1.02,
        **kw: Any,
    ) -> None:
        if base not in BASES:
            raise ConfigError("algorithm.base", f"must be one of {tuple(BASES)}, got {base!r}")
        check_grasp(tau1, tau2, steps, delta)
        kw.setdefault("name", "grasp")
        super().__init__(**kw)
        self.base, self.tau1, self.tau2 = base, float(tau1), float(tau2)
        self.steps, self.delta = steps, float(delta)

    def propagate(self, base: Tensor, data: Any, train: Tensor) -> Tensor:
        """GRASP on one client's subgraph: select :math:`G`, then propagate ``base``."""
        candidates = data.val_mask | data.test_mask
        g = grasp_selection(base, data.edge_index, candidates, train, self.tau1, self.tau2)
        return grasp_propagate(base, data.edge_index, g, self.steps, self.delta)

    def node_score(
        self, logits: Tensor, known: Tensor, data: Any, reps: dict, global_state: dict
    ) -> Tensor:
        """Every node's propagated base score (before the sign)."""
        base = BASES[self.base](logits, known)
        known_ids = known.bool().nonzero().squeeze(1)
        train = data.train_mask & torch.isin(data.y, known_ids)
        return self.propagate(base, data, train)


class RetrievalGRASP(ContinualRetrieval):
    """Cross-modal retrieval whose rejection score is GRASP's propagated top-1 similarity.

    Per client, every node's base score is its highest cosine similarity to the known-class
    items of its own split (the loop's similarity score); the candidates are the validation
    and test nodes that have the query modality, the training nodes those of the known
    classes; :math:`G` is selected and the score propagated as in :class:`GRASP`. The sign
    is calibrated on validation; no extra communication.

    Args:
        tau1, tau2, steps, delta: as :class:`GRASP`.
        **kw: as :class:`~fedlightning.methods.continual.retrieval_baselines.ContinualRetrieval`.
    """

    calibrate_direction = True

    def __init__(
        self,
        tau1: float = 0.05,
        tau2: float = 0.5,
        steps: int = 8,
        delta: float = 1.02,
        **kw: Any,
    ) -> None:
        check_grasp(tau1, tau2, steps, delta)
        kw.setdefault("name", "grasp")
        super().__init__(**kw)
        self.tau1, self.tau2 = float(tau1), float(tau2)
        self.steps, self.delta = steps, float(delta)

    @torch.no_grad()
    def query_scores(
        self, net: Any, q: Tensor, k: Tensor, data: Any, is_known: Tensor, global_state: dict
    ) -> Tensor:
        """Every node's propagated top-1 similarity (before the sign)."""
        base = split_scores(max_similarity, q, k, is_known & net.pair_mask(data), data)
        candidates = (data.val_mask | data.test_mask) & net.availability(data, net.query)
        train = data.train_mask & is_known
        g = grasp_selection(base, data.edge_index, candidates, train, self.tau1, self.tau2)
        return grasp_propagate(base, data.edge_index, g, self.steps, self.delta)
