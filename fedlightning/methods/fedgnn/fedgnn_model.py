"""FedGNN's model, its local DP and pseudo-items, and the user-item graph of the pre-training
history that FedGNN and FedLink read (docs/fedtip.md, "FedGNN")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlightning.data.temporal.manifest import PRETRAIN, PREVAL
from fedlightning.methods.history.history import tensor_digest


@dataclass
class HistoryGraph:
    """The user-item graph of the pre-training history (a node's source role is its user row,
    its destination role its item row; ``-1``: none), each edge's user's ``owner`` and each
    row's bank state at the history's end."""

    user_ids: np.ndarray
    item_ids: np.ndarray
    user_row: np.ndarray
    item_row: np.ndarray
    edge_u: np.ndarray
    edge_i: np.ndarray
    owner: np.ndarray
    user_state: Tensor
    item_state: Tensor
    hash: str

    @property
    def num_users(self) -> int:
        return len(self.user_ids)

    @property
    def num_items(self) -> int:
        return len(self.item_ids)

    def rows(self, src: np.ndarray, dst: np.ndarray) -> tuple[Tensor, Tensor]:
        """The user rows of ``src`` and item rows of ``dst`` (node ids)."""
        return torch.from_numpy(self.user_row[src]), torch.from_numpy(self.item_row[dst])

    def adjacency(self, keep: np.ndarray | None = None, items_to_users: bool = False) -> RowMean:
        """The :class:`RowMean` adjacency (users x items, or items x users) of edges ``keep``."""
        u, i = self.edge_u, self.edge_i
        if keep is not None:
            u, i = u[keep], i[keep]
        if items_to_users:
            return RowMean(i, u, (self.num_items, self.num_users))
        return RowMean(u, i, (self.num_users, self.num_items))


class RowMean:
    """A row-normalised adjacency (multiplicity over degree), stored by rows."""

    def __init__(self, rows: np.ndarray, cols: np.ndarray, shape: tuple[int, int]) -> None:
        order = np.argsort(rows, kind="stable")
        self.cols = np.asarray(cols, np.int64)[order]
        deg = np.bincount(rows, minlength=shape[0])
        self.indptr = np.concatenate([[0], np.cumsum(deg)])
        self.inv = (1.0 / np.maximum(deg, 1)).astype(np.float32)
        self.shape = shape

    def rows(self, sel: Tensor) -> Tensor:
        """Rows ``sel`` as a sparse COO ``[len(sel), cols]``."""
        sel = sel.numpy()
        starts, ends = self.indptr[sel], self.indptr[sel + 1]
        lens = ends - starts
        r = np.repeat(np.arange(len(sel)), lens)
        first = np.cumsum(lens) - lens
        take = np.arange(int(lens.sum())) - np.repeat(first - starts, lens)
        c = self.cols[take]
        v = np.repeat(self.inv[sel], lens)
        idx = torch.from_numpy(np.stack([r, c]).astype(np.int64))
        shape = (len(sel), self.shape[1])
        return torch.sparse_coo_tensor(idx, torch.from_numpy(v), shape, check_invariants=False)

    def all(self) -> Tensor:
        """The whole matrix, sparse COO."""
        return self.rows(torch.arange(self.shape[0]))

    def neighbours(self, sel: Tensor) -> Tensor:
        """The distinct columns of rows ``sel``."""
        sel = sel.numpy()
        parts = [self.cols[self.indptr[v] : self.indptr[v + 1]] for v in sel]
        return torch.from_numpy(
            np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
        )


@torch.no_grad()
def history_graph(protocol, snapshot, chunk: int = 1024) -> HistoryGraph:
    """The protocol's :class:`HistoryGraph`, states from a fork of the bank's ``snapshot``."""
    from fedlightning.temporal.contexts import fork

    stream, manifest = protocol.stream, protocol.manifest
    hist = np.flatnonzero((manifest.outcome == PRETRAIN) | (manifest.outcome == PREVAL))
    user_ids, item_ids = np.unique(stream.src), np.unique(stream.dst)
    user_row = np.full(stream.num_nodes, -1, np.int64)
    item_row = np.full(stream.num_nodes, -1, np.int64)
    user_row[user_ids], item_row[item_ids] = np.arange(len(user_ids)), np.arange(len(item_ids))
    src, dst = stream.src[hist], stream.dst[hist]
    owner = np.asarray(protocol.ownership.owner)[src].astype(np.int64)
    enc = fork(snapshot)
    t_end = float(stream.t[hist[-1]]) if len(hist) else 0.0

    def states(ids: np.ndarray) -> Tensor:
        out = []
        for s in range(0, len(ids), chunk):
            n = torch.from_numpy(ids[s : s + chunk].astype(np.int64))
            out.append(enc.embed(n, torch.full((len(n),), t_end)).float())
        return torch.cat(out) if out else torch.zeros(0, enc.out_dim)

    us, its = states(user_ids), states(item_ids)
    eu, ei = user_row[src], item_row[dst]
    digest = tensor_digest(user_ids, item_ids, eu, ei, owner, us, its)
    return HistoryGraph(user_ids, item_ids, user_row, item_row, eu, ei, owner, us, its, digest)


# ---------------------------------------------------------------------- evaluation
class ScoreView(nn.Module):
    """A baseline's own scores read as an adapter by ``score_segment``: a score ``s`` in the
    recency slots maps to ``[s, 1]`` (link prediction) or ``[s, -s, 1]`` (node
    classification), whose cosines are increasing in ``s``: the AUC is the score's."""

    def forward(self, h_u, h_side, te, x, r_u, r_side) -> Tensor:  # noqa: ANN001
        s = r_side.to(torch.float64)
        if h_side.size(-1) == 3:  # node classification
            return torch.stack([s, -s, torch.ones_like(s)], -1)
        return torch.stack([s, torch.ones_like(s)], -1)

    @staticmethod
    def prototypes() -> dict[int, Tensor]:
        """The node classification prototypes: class 1 ``e_1``, class 0 ``e_2``."""
        return {1: torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64),
                0: torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)}  # fmt: skip


def scored_segment(batch: dict[str, Tensor], pos: Tensor, neg: Tensor | None) -> dict[str, Tensor]:
    """A one-client segment with ``pos`` (node logits if ``neg=None``), ``neg`` in place."""
    out = dict(batch)
    n = batch["mask"].size(1)
    width = 3 if neg is None else 2
    ref = torch.zeros(1, n, width, dtype=torch.float64)
    ref[..., 0] = 1.0
    out["h_i"], out["h_j"] = ref, ref
    out["r_i"] = pos.to(torch.float64).view(1, n)
    out["r_j"] = (neg if neg is not None else pos).to(torch.float64).view(1, n)
    return out


# ---------------------------------------------------------------------- privacy
def clip_norm(grad: Tensor, delta: float) -> Tensor:
    """FedGNN's ``clip(g, delta)``: the tensor clipped to L2 norm ``delta``."""
    norm = float(grad.norm())
    return grad * (delta / norm) if norm > delta else grad


def laplace(shape: tuple[int, ...], scale: float, generator: torch.Generator | None) -> Tensor:
    """Laplace(0, ``scale``) noise by the inverse CDF."""
    u = torch.rand(shape, generator=generator, dtype=torch.float64) - 0.5
    return (-scale * u.sign() * torch.log1p(-2 * u.abs())).float()


def ldp_scale(lr: float, delta: float, epsilon: float) -> float:
    """FedGNN's Laplace scale ``2 delta lr / epsilon`` (two uploads differ by <= 2 lr delta)."""
    return 2.0 * delta * lr / epsilon


def ldp_update(
    delta: Tensor, lr: float, clip: float, epsilon: float, generator: torch.Generator | None
) -> Tensor:
    """``delta`` plus :func:`laplace` noise of :func:`ldp_scale` (none for ``epsilon <= 0``)."""
    if epsilon <= 0:
        return delta
    return delta + laplace(tuple(delta.shape), ldp_scale(lr, clip, epsilon), generator)


def pseudo_items(
    touched: Tensor, num_items: int, count: int, generator: torch.Generator | None
) -> Tensor:
    """FedGNN's pseudo-interacted items: ``count`` untouched rows drawn without replacement."""
    free = torch.ones(num_items, dtype=torch.bool)
    free[touched] = False
    pool = torch.nonzero(free).flatten()
    pick = torch.randperm(len(pool), generator=generator)[: min(count, len(pool))]
    return pool[pick].sort().values


def fake_gradients(real: Tensor, rows: int, generator: torch.Generator | None) -> Tensor:
    """Fake updates [rows, d] ~ N(0, sigma^2), sigma the ``real`` rows' standard deviation."""
    sigma = float(real.std()) if real.numel() > 1 else 0.0
    return torch.randn((rows, real.size(-1)), generator=generator) * sigma


# ---------------------------------------------------------------------- model
class FedGNNModel(nn.Module):
    """FedGNN's model: ``z_u = tanh(W_u [h_u | mean of N(u)'s item rows])``, ``z_i =
    tanh(W_i [E_i | n_i])`` (``n_i``: the graph expansion), ``s = z_u . z_i``; a logistic head
    on ``z_u`` for node classification; ``E`` from the bank or N(0, 0.1^2) (``init``)."""

    def __init__(self, graph: HistoryGraph, init: str = "bank") -> None:
        super().__init__()
        if init not in ("bank", "random"):
            raise ValueError(f"init must be bank or random, got {init!r}")
        d = graph.item_state.size(1)
        table = (
            graph.item_state.clone() if init == "bank" else torch.randn(graph.num_items, d) * 0.1
        )
        self.items = nn.Parameter(table)
        self.gnn_u = nn.Linear(2 * d, d)
        self.gnn_i = nn.Linear(2 * d, d)
        self.head = nn.Linear(d, 1)
        object.__setattr__(self, "graph", graph)
        self.register_buffer(
            "expansion",
            torch.sparse.mm(graph.adjacency(items_to_users=True).all(), graph.user_state),
        )
        self.user_items = graph.adjacency()  # [users, items], constant

    def num_values(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def users(self, h_u: Tensor, agg: Tensor) -> Tensor:
        """``z_u`` of the event-time states and their item means ``agg``."""
        return torch.tanh(self.gnn_u(torch.cat([h_u, agg], -1)))

    def item_side(self, rows: Tensor) -> Tensor:
        """``z_i`` of item ``rows``."""
        return torch.tanh(self.gnn_i(torch.cat([self.items[rows], self.expansion[rows]], -1)))

    def aggregate(self, user_rows: Tensor) -> Tensor:
        """The item-embedding mean of each of ``user_rows``."""
        return torch.sparse.mm(self.user_items.rows(user_rows), self.items)


def dot_scores(z_u: Tensor, z_v: Tensor) -> Tensor:
    """Row-wise dot products."""
    return (z_u * z_v).sum(-1)


def mse_link_loss(pos: Tensor, neg: Tensor, ok: Tensor) -> Tensor:
    """FedGNN's rating loss as link prediction: mean ``(s+ - 1)^2`` and ``(s-)^2`` where ``ok``."""
    err = torch.cat([(pos - 1) ** 2, neg**2])[torch.cat([ok, ok])]
    return err.mean() if err.numel() else pos.sum() * 0


def bce_node_loss(logit: Tensor, y: Tensor) -> Tensor:
    """The added node classification head's binary cross-entropy."""
    return F.binary_cross_entropy_with_logits(logit, y.float())
