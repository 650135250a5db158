"""Feddy (Jiang et al., ACM TIST 2022; docs/fedtip.md, "Feddy"): :class:`FeddyNet` with a
self-supervised trajectory term on the client's own users' history; FedAvg."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fedlightning.federation.task_loop import TaskContext
from fedlightning.methods.dynamic.dynamic_baselines import DynamicBaseline, client_nodes, stack_rows
from fedlightning.methods.dynamic.dynamic_model import FeddyNet
from fedlightning.utils.seeding import derive_seed


def trajectory_samples(
    view, users: np.ndarray, size: int, seed: int
) -> dict[str, Tensor]:  # fmt: skip
    """Up to ``size`` seeded (node, window ``w``) pairs of ``users`` with neighbours in ``w``
    and ``w + 1``: state, means at ``w`` and ``w - 1``, and the target mean at ``w + 1``."""
    deg = view.degree[:, users]
    w, k = np.nonzero(((deg[1:-1] > 0) & (deg[2:] > 0)).numpy())
    w = w + 1
    if len(w) > size:
        pick = np.sort(np.random.default_rng(seed).choice(len(w), size, replace=False))
        w, k = w[pick], k[pick]
    v = torch.from_numpy(users[k])
    wt = torch.from_numpy(w)
    return {
        "traj_s": view.states[wt, v],
        "traj_m": view.means[wt, v],
        "traj_p": view.means[wt - 1, v],
        "traj_next": view.means[wt + 1, v],
    }


@dataclass
class Feddy(DynamicBaseline):
    """Feddy; ``lambda_traj``: the trajectory term's weight; ``samples`` per client."""

    name: str = "feddy"
    lambda_traj: float = 1.0
    samples: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        self._traj: dict[int, dict[str, Tensor]] = {}

    def net(self, d_h: int) -> FeddyNet:
        return FeddyNet(d_h, self.hidden)

    def client_terms(self) -> dict[str, float]:
        return {"lambda_traj": self.lambda_traj}

    def event_inputs(self, nodes: dict[str, Tensor]) -> dict[str, Tensor]:
        last, prev = self.snapshot_means(nodes, 0), self.snapshot_means(nodes, 1)
        return {**{f"m_{s}": v for s, v in last.items()}, **{f"p_{s}": v for s, v in prev.items()}}

    def client_extras(self, context: TaskContext, clients: list[int]) -> dict[str, Tensor]:
        owner = self.protocol.ownership.owner
        for k in clients:
            if k not in self._traj:
                seed = derive_seed(context.seed, "trajectory", k)
                self._traj[k] = trajectory_samples(
                    self.view, client_nodes(owner, k), self.samples, seed
                )
        rows = stack_rows([self._traj[k] for k in clients])
        rows["traj_mask"] = rows.pop("mask")
        return rows

    def materialize_views(self, cache_dir=None) -> dict[str, str]:
        self._traj = {}
        return super().materialize_views(cache_dir)
