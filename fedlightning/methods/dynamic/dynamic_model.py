"""The nets of Feddy, STFL and FedDGL (docs/fedtip.md, "Published baselines") on the bank's
states, each stacked: ``copies`` parameter sets over inputs [K, N, ...], one per client."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlightning.temporal.adapter import StackedCopies, StackedLinear

Batch = dict[str, Tensor]
EDGES = ("interaction", "knn")  # STFL's per-event adjacency


class StackedNet(StackedCopies, nn.Module):
    """Copies, loading and sizes shared by the nets (each keeps its ``config``)."""

    config: dict

    def __init__(self) -> None:
        super().__init__()
        self.copies = 1

    @property
    def d_h(self) -> int:
        return int(self.config["d_h"])

    def num_values(self) -> int:
        """Float32 values of one copy (one client's model)."""
        return sum(p.numel() for p in self.parameters()) // self.copies

    def stacked(self, copies: int) -> StackedNet:
        out = type(self)(**self.config, copies=copies)
        out.load_copies([self.copy_state(0)] * copies)
        return out

    def load_copies(self, states: list[dict[str, Tensor]]) -> None:
        """Copy ``k`` from the single-copy ``states[k]``."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(torch.cat([s[name] for s in states]))

    def represent(self, batch: Batch, side: str) -> Tensor:
        """[K, N, d_h]: the pair (u, ``side``)'s representation."""
        raise NotImplementedError

    def target(self, batch: Batch, side: str, rep: Tensor) -> Tensor:
        """What the pair representation is scored against by cosine (link prediction)."""
        raise NotImplementedError

    def views(self, batch: Batch, family: str) -> tuple[Tensor, ...]:
        """:func:`~fedlightning.clients.temporal_prompt.family_views`'s tuple."""
        rep_i = self.represent(batch, "i")
        if family == "nc":
            return rep_i, batch["y"], batch["mask"]
        rep_j = self.represent(batch, "j")
        return (
            rep_i,
            self.target(batch, "i", rep_i),
            rep_j,
            self.target(batch, "j", rep_j),
            batch["mask"] & batch["neg_ok"],
        )


# ---------------------------------------------------------------------------------- Feddy
def feddy_layer(
    w_0: StackedLinear, w_s: StackedLinear, w_d: StackedLinear, s: Tensor, m: Tensor, p: Tensor
) -> Tensor:
    """Feddy's ``ReLU(W_0 s + W_s m^T + W_d m^(T-1))`` of a node's state and its current and
    previous snapshots' neighbour means."""
    return F.relu(w_0(s) + w_s(m) + w_d(p))


def trajectory_loss(pred: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """Feddy's trajectory term: each client's mean squared error, summed over clients."""
    err = ((pred - target) ** 2).sum(-1) * mask
    return (err.sum(1) / mask.sum(1).clamp(min=1)).sum()


class FeddyNet(StackedNet):
    """Feddy: :func:`feddy_layer` to ``hidden``, back to ``d_h``; a trajectory head ``P``."""

    def __init__(self, d_h: int, hidden: int = 128, copies: int = 1) -> None:
        super().__init__()
        self.config, self.copies = dict(d_h=d_h, hidden=hidden), copies
        self.w_0 = StackedLinear(copies, d_h, hidden)
        self.w_s = StackedLinear(copies, d_h, hidden, bias=False)
        self.w_d = StackedLinear(copies, d_h, hidden, bias=False)
        self.out = StackedLinear(copies, hidden, d_h)
        self.traj = StackedLinear(copies, d_h, d_h)

    def node(self, s: Tensor, m: Tensor, p: Tensor) -> Tensor:
        return self.out(feddy_layer(self.w_0, self.w_s, self.w_d, s, m, p))

    def represent(self, batch: Batch, side: str) -> Tensor:
        return self.node(batch["h_u"], batch["m_u"], batch["p_u"])

    def target(self, batch: Batch, side: str, rep: Tensor) -> Tensor:
        return self.node(batch[f"h_{side}"], batch[f"m_{side}"], batch[f"p_{side}"])

    def trajectory(self, extras: Batch) -> Tensor:
        """:func:`trajectory_loss` on the clients' history samples (``traj_*``)."""
        z = self.node(extras["traj_s"], extras["traj_m"], extras["traj_p"])
        return trajectory_loss(self.traj(z), extras["traj_next"], extras["traj_mask"])


# ----------------------------------------------------------------------------------- STFL
def event_graph(u: Tensor, v: Tensor, nb_u: Tensor, nb_v: Tensor) -> Tensor:
    """STFL's per-event nodes [..., 2 + 2L, d]: source, target, their recent neighbours."""
    return torch.cat([u.unsqueeze(-2), v.unsqueeze(-2), nb_u, nb_v], -2)


def interaction_adjacency(ok_u: Tensor, ok_v: Tensor) -> Tensor:
    """:func:`event_graph`'s adjacency by real interactions: source-target, each endpoint
    with its existing neighbours (``ok_*``)."""
    shape, L = ok_u.shape[:-1], ok_u.size(-1)
    n = 2 + 2 * L
    a = torch.zeros(*shape, n, n, dtype=torch.bool, device=ok_u.device)
    a[..., 0, 1] = a[..., 1, 0] = True
    a[..., 0, 2 : 2 + L] = ok_u
    a[..., 1, 2 + L :] = ok_v
    return a | a.transpose(-1, -2)


def knn_adjacency(x: Tensor, ok: Tensor, k: int) -> Tensor:
    """STFL's kNN graph: each valid node to its ``k`` most cosine-similar (symmetrised)."""
    sim = F.normalize(x, dim=-1) @ F.normalize(x, dim=-1).transpose(-1, -2)
    invalid = ~(ok.unsqueeze(-1) & ok.unsqueeze(-2))
    eye = torch.eye(x.size(-2), dtype=torch.bool, device=x.device)
    sim = sim.masked_fill(invalid | eye, float("-inf"))
    top = sim.topk(min(k, x.size(-2) - 1), dim=-1).indices
    a = torch.zeros_like(invalid).scatter_(-1, top, True) & ~invalid & ~eye
    return a | a.transpose(-1, -2)


def sage_mean(root: StackedLinear, nbr: StackedLinear, x: Tensor, adj: Tensor) -> Tensor:
    """GraphSAGE-mean ``ReLU(W_r x + W_n mean of N(v))`` on dense graphs [K, N, n, ...]."""
    a = adj.to(x.dtype)
    mean = (a @ x) / a.sum(-1, keepdim=True).clamp(min=1)
    k, n_ev, n, d = x.shape
    out = root(x.reshape(k, n_ev * n, d)) + nbr(mean.reshape(k, n_ev * n, d))
    return F.relu(out).reshape(k, n_ev, n, -1)


def mean_readout(h: Tensor, ok: Tensor) -> Tensor:
    """The graph's representation: the mean over its valid nodes ``[..., n] -> [..., d]``."""
    w = ok.to(h.dtype).unsqueeze(-1)
    return (h * w).sum(-2) / w.sum(-2).clamp(min=1)


class STFLNet(StackedNet):
    """STFL: two :func:`sage_mean` layers, :func:`mean_readout`, a map to ``d_h``; link
    prediction scores against a learned direction ``w``."""

    def __init__(
        self, d_h: int, hidden: int = 32, edges: str = "interaction", knn: int = 3, copies: int = 1
    ) -> None:
        super().__init__()
        if edges not in EDGES:
            raise ValueError(f"edges must be one of {EDGES}, got {edges!r}")
        self.config = dict(d_h=d_h, hidden=hidden, edges=edges, knn=knn)
        self.copies, self.edges, self.knn = copies, edges, knn
        self.root1, self.nbr1 = StackedLinear(copies, d_h, hidden), StackedLinear(copies, d_h, hidden, bias=False)  # fmt: skip
        self.root2, self.nbr2 = StackedLinear(copies, hidden, hidden), StackedLinear(copies, hidden, hidden, bias=False)  # fmt: skip
        self.out = StackedLinear(copies, hidden, d_h)
        self.w = nn.Parameter(torch.randn(copies, 1, d_h) / d_h**0.5)

    def graph(self, batch: Batch, side: str) -> tuple[Tensor, Tensor, Tensor]:
        """Features, adjacency and validity of the (u, ``side``) events' graphs."""
        ok_u, ok_v = batch["nm_u"], batch[f"nm_{side}"]
        x = event_graph(batch["h_u"], batch[f"h_{side}"], batch["nb_u"], batch[f"nb_{side}"])
        ok = torch.cat([torch.ones_like(ok_u[..., :2]), ok_u, ok_v], -1)
        adj = (
            interaction_adjacency(ok_u, ok_v)
            if self.edges == "interaction"
            else knn_adjacency(x, ok, self.knn)
        )
        return x, adj, ok

    def represent(self, batch: Batch, side: str) -> Tensor:
        x, adj, ok = self.graph(batch, side)
        h = sage_mean(self.root1, self.nbr1, x, adj)
        h = sage_mean(self.root2, self.nbr2, h, adj)
        return self.out(mean_readout(h, ok))

    def target(self, batch: Batch, side: str, rep: Tensor) -> Tensor:
        return self.w.expand_as(rep)


# --------------------------------------------------------------------------------- FedDGL
class StackedGRU(nn.Module):
    """A GRU cell (``width`` in and out) per copy, on rows ``[K, R, width]``."""

    def __init__(self, copies: int, width: int) -> None:
        super().__init__()
        self.x = StackedLinear(copies, width, 3 * width)
        self.h = StackedLinear(copies, width, 3 * width)

    def forward(self, x: Tensor, h: Tensor) -> Tensor:
        xr, xz, xn = self.x(x).chunk(3, -1)
        hr, hz, hn = self.h(h).chunk(3, -1)
        r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        return (1 - z) * n + z * h


def self_input_gates(gru: StackedGRU) -> tuple[Tensor, Tensor]:
    """The GRU's fused gates when input = hidden: rows ``[r+z summed | xn | hn]`` [K, 4H, H]
    and their biases."""
    width = gru.x.weight.size(-1)
    wx, wh, bx, bh = gru.x.weight, gru.h.weight, gru.x.bias, gru.h.bias
    rz = 2 * width
    weight = torch.cat([wx[:, :rz] + wh[:, :rz], wx[:, rz:], wh[:, rz:]], 1)
    bias = torch.cat([bx[:, :rz] + bh[:, :rz], bx[:, rz:], bh[:, rz:]], 1)
    return weight, bias


def evolve_weights(w0: Tensor, gru: StackedGRU, steps: int) -> Tensor:
    """EvolveGCN-O: ``W <- GRU(W, W)`` ``steps`` times from ``w0`` [K, d_in, d_out]."""
    if steps == 0:
        return w0
    weight, bias = self_input_gates(gru)
    weight_t, bias = weight.transpose(1, 2), bias.unsqueeze(1)
    width = w0.size(-1)
    w = w0
    for _ in range(steps):
        rz, xn, hn = torch.baddbmm(bias, w, weight_t).split([2 * width, width, width], -1)
        r, z = torch.sigmoid(rz).chunk(2, -1)
        n = torch.tanh(xn + r * hn)
        w = n + z * (w - n)  # (1 - z) n + z w
    return w


def gcn_mean(s: Tensor, m: Tensor, deg: Tensor) -> Tensor:
    """The row-normalised GCN input with a self loop, ``(s + d m) / (d + 1)``."""
    d = deg.unsqueeze(-1)
    return (s + d * m) / (d + 1)


class FedDGLNet(StackedNet):
    """FedDGL: ``z = dec(ReLU(gcn_mean W))``, ``W`` evolved over ``windows`` snapshots."""

    def __init__(self, d_h: int, hidden: int = 128, windows: int = 10, copies: int = 1) -> None:
        super().__init__()
        self.config = dict(d_h=d_h, hidden=hidden, windows=windows)
        self.copies, self.windows = copies, windows
        self.w0 = nn.Parameter(torch.empty(copies, d_h, hidden))
        for k in range(copies):
            nn.init.xavier_uniform_(self.w0.data[k])
        self.gru = StackedGRU(copies, hidden)
        self.dec = StackedLinear(copies, hidden, d_h)

    def node(self, s: Tensor, m: Tensor, deg: Tensor, w: Tensor) -> Tensor:
        return self.dec(F.relu(torch.bmm(gcn_mean(s, m, deg), w)))

    def views(self, batch: Batch, family: str) -> tuple[Tensor, ...]:
        """The views with the weights evolved once and all sides in one product: ``z_u``
        scored against ``z_i`` and ``z_j``."""
        w = evolve_weights(self.w0, self.gru, self.windows)
        sides = ("u",) if family == "nc" else ("u", "i", "j")
        n = batch["h_u"].size(1)
        z = self.node(
            torch.cat([batch[f"h_{s}"] for s in sides], 1),
            torch.cat([batch[f"m_{s}"] for s in sides], 1),
            torch.cat([batch[f"d_{s}"] for s in sides], 1),
            w,
        ).split(n, 1)
        if family == "nc":
            return z[0], batch["y"], batch["mask"]
        return z[0], z[1], z[0], z[2], batch["mask"] & batch["neg_ok"]

    def represent(self, batch: Batch, side: str) -> Tensor:
        w = evolve_weights(self.w0, self.gru, self.windows)
        return self.node(batch["h_u"], batch["m_u"], batch["d_u"], w)

    def target(self, batch: Batch, side: str, rep: Tensor) -> Tensor:
        w = evolve_weights(self.w0, self.gru, self.windows)
        return self.node(batch[f"h_{side}"], batch[f"m_{side}"], batch[f"d_{side}"], w)
