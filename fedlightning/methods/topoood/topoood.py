"""TopoOOD (Bao et al., ICML 2024) in the class-incremental stream (docs/fedogl.md,
"TopoOOD"): FedAvg + replay rejecting by the known-class logits' Dirichlet energy."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from fedlightning.errors import ConfigError
from fedlightning.methods.continual.continual import ContinualFedAvg
from fedlightning.methods.topoood.topoood_score import dirichlet_energy, mean_propagation


class TopoOOD(ContinualFedAvg):
    """FedAvg + replay with TopoOOD's energy smoothed ``prop_steps`` times (``prop_alpha``)."""

    calibrate_direction = True

    def __init__(self, prop_steps: int = 2, prop_alpha: float = 0.5, **kw: Any) -> None:
        if isinstance(prop_steps, bool) or not isinstance(prop_steps, int) or prop_steps < 0:
            raise ConfigError(
                "algorithm.prop_steps", f"must be an integer >= 0, got {prop_steps!r}"
            )
        if not 0.0 <= float(prop_alpha) <= 1.0:
            raise ConfigError("algorithm.prop_alpha", f"must be in [0, 1], got {prop_alpha!r}")
        kw.setdefault("name", "topoood")
        super().__init__(**kw)
        self.prop_steps, self.prop_alpha = prop_steps, float(prop_alpha)

    def node_score(
        self, logits: Tensor, known: Tensor, data: Any, reps: dict, global_state: dict
    ) -> Tensor:
        energy = dirichlet_energy(logits[:, known.bool()], data.edge_index)
        return mean_propagation(energy, data.edge_index, self.prop_steps, self.prop_alpha)
