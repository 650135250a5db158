r"""Class-incremental metrics: the accuracy matrix and AM / FM / seen-task curves.

Stages are 0-based in code. ``M[t, j]`` is the accuracy, after training stage ``t``, on the
test nodes of the classes that stage ``j`` introduced, pooled over clients (weighted by test
nodes). Entries never measured (``j > t``, or no test node) are NaN. ``T`` is the number of
stages, so the final row is ``M[T-1]`` (``M[T]`` in the paper's 1-based notation)."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torchmetrics import Metric

__all__ = [
    "AccuracyMatrix",
    "average_accuracy",
    "forgetting",
    "forgetting_diag",
    "seen_accuracy_curve",
]


class AccuracyMatrix(Metric):
    r"""Accumulates the task-wise accuracy matrix of a class-incremental stream.

    .. math::
        M_{t,j} = \frac{\sum_k \#\{i \in \mathcal{V}^{test}_{k,j} :
        \hat{y}_i^{t} = y_i\}}{\sum_k |\mathcal{V}^{test}_{k,j}|}

    where :math:`\mathcal{V}^{test}_{k,j}` are client :math:`k`'s test nodes whose class was
    introduced at stage :math:`j`: :meth:`update` once per client sums counts, so clients
    weigh by test nodes (``[T, T]`` sum states, so DDP reduces correctly too).

    Shapes: update ``node_stage`` :math:`(N,)` int, ``correct`` :math:`(N,)` bool; compute
    :math:`(T, T)` float64, NaN where nothing was counted."""

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    correct: Tensor
    total: Tensor

    def __init__(self, num_stages: int, **kwargs) -> None:
        super().__init__(**kwargs)
        if num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {num_stages}")
        self.num_stages = int(num_stages)
        zeros = torch.zeros(num_stages, num_stages, dtype=torch.long)
        self.add_state("correct", default=zeros.clone(), dist_reduce_fx="sum")
        self.add_state("total", default=zeros.clone(), dist_reduce_fx="sum")

    def update(self, stage: int, node_stage: Tensor, correct: Tensor) -> None:
        """Count one client's (or batch's) nodes after training stage ``stage``: each node's
        introducing stage (``> stage``, e.g. open-world unknowns: ignored) and whether its
        closed-set prediction was right."""
        T = self.num_stages
        if not 0 <= stage < T:
            raise ValueError(f"stage must be in [0, {T}), got {stage}")
        node_stage = torch.as_tensor(node_stage, device=self.correct.device).long().flatten()
        correct = torch.as_tensor(correct, device=self.correct.device).bool().flatten()
        if node_stage.shape != correct.shape:
            raise ValueError(
                f"node_stage and correct differ in length: {node_stage.numel()} vs "
                f"{correct.numel()}"
            )
        if (node_stage < 0).any():
            raise ValueError("node_stage must be >= 0 (a stage index)")
        seen = node_stage <= stage
        js = node_stage[seen]
        self.total[stage] += torch.bincount(js, minlength=T)[:T]
        self.correct[stage] += torch.bincount(js[correct[seen]], minlength=T)[:T]

    def compute(self) -> Tensor:
        """The matrix ``correct / total`` in float64, NaN where ``total == 0``."""
        total = self.total.to(torch.float64)
        out = self.correct.to(torch.float64) / total.clamp_min(1)
        return out.masked_fill(self.total == 0, math.nan)


def _as_matrix(M: Tensor) -> Tensor:
    """``M`` as a square float64 tensor on CPU (accepts nested lists and arrays too)."""
    M = torch.as_tensor(M, dtype=torch.float64).cpu()
    if M.dim() != 2 or M.shape[0] != M.shape[1] or M.shape[0] == 0:
        raise ValueError(f"expected a non-empty square [T, T] matrix, got shape {tuple(M.shape)}")
    return M


def _finite_mean(x: Tensor) -> float:
    """Mean over the finite entries of ``x``; NaN if there are none."""
    x = x[torch.isfinite(x)]
    return float(x.mean()) if x.numel() else math.nan


def average_accuracy(M: Tensor) -> float:
    r"""Average accuracy (AM) after the final stage over all seen tasks.

    .. math::
        \mathrm{AM} = \frac{1}{T} \sum_{j=0}^{T-1} M_{T-1,j}

    Tasks without a measured value (NaN) are left out of the mean; NaN if none is finite.
    ``M`` :math:`(T, T)`, row ``t`` = after stage ``t`` (as for every function here)."""
    M = _as_matrix(M)
    return _finite_mean(M[-1])


def _forgetting(M: Tensor, diag: bool) -> float:
    M = _as_matrix(M)
    T = M.shape[0]
    if T == 1:
        return 0.0
    old = M[:-1, :-1]  # old task j (column) after stage t < T-1 (row)
    if diag:
        ref = old.diagonal()
    else:  # the best finite M[t, j] over j <= t < T-1, -inf when none
        earlier = torch.ones_like(old, dtype=torch.bool).tril() & torch.isfinite(old)
        ref = old.masked_fill(~earlier, -math.inf).amax(dim=0)
    d = ref - M[-1, :-1]
    drops = d[torch.isfinite(d)].tolist()
    return sum(drops) / len(drops) if drops else math.nan


def forgetting(M: Tensor) -> float:
    r"""Forgetting measure (FM): mean drop of each old task from its best earlier value.

    .. math::
        \mathrm{FM} = \frac{1}{T-1} \sum_{j=0}^{T-2}
        \Big( \max_{j \le t < T-1} M_{t,j} - M_{T-1,j} \Big)

    The drop is signed, as in the FedOGL paper. NaN entries are skipped inside the max; a
    task with no finite reference or final value is left out of the mean; 0 when
    :math:`T = 1`."""
    return _forgetting(M, diag=False)


def forgetting_diag(M: Tensor) -> float:
    r"""Diagonal forgetting (``fm_diag``): mean drop of each old task from when it was learned.

    .. math::
        \mathrm{FM}_{diag} = \frac{1}{T-1} \sum_{j=0}^{T-2} \big( M_{j,j} - M_{T-1,j} \big)

    Signed; tasks with a non-finite term are left out; 0 when :math:`T = 1`."""
    return _forgetting(M, diag=True)


def seen_accuracy_curve(M: Tensor) -> list[float]:
    r"""Average accuracy over the tasks seen so far, after each stage.

    .. math::
        a_t = \frac{1}{t+1} \sum_{j=0}^{t} M_{t,j}, \qquad t = 0, \dots, T-1

    Non-finite entries are left out of each mean (NaN if a row has none); the last value
    equals :func:`average_accuracy`."""
    M = _as_matrix(M)
    return [_finite_mean(M[t, : t + 1]) for t in range(M.shape[0])]
