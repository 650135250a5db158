"""FedSage+'s model pieces (Zhang et al., NeurIPS 2021; docs/fedtip.md, "FedSage+"): NeighGen
trained on an impaired graph, the graph mended, a 2-layer GraphSAGE trained on it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlightning.methods.fedgcn.fedgcn_model import neighbour_sums
from fedlightning.models.dropout import Dropout


def sage_mean(h: Tensor, edge_index: Tensor) -> Tensor:
    """GraphSAGE's mean aggregator (zeros for a node without neighbours)."""
    s, c = neighbour_sums(h, edge_index, h.size(0))
    return s / c.clamp(min=1).unsqueeze(1)


class SageLayer(nn.Module):
    """``W_s h_v + W_n mean of N(v) + b``."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.self_lin, self.nb_lin = nn.Linear(d_in, d_out), nn.Linear(d_in, d_out, bias=False)

    def forward(self, h: Tensor, edge_index: Tensor) -> Tensor:
        return self.self_lin(h) + self.nb_lin(sage_mean(h, edge_index))


class SageNet(nn.Module):
    """The classifier: two :class:`SageLayer` s with a ReLU between (latent ``hidden``)."""

    hops = 2  # the receptive field: two aggregations

    def __init__(self, d_in: int, hidden: int = 128, d_out: int = 64, dropout: float = 0.0) -> None:
        super().__init__()
        self.conv1, self.conv2 = SageLayer(d_in, hidden), SageLayer(hidden, d_out)
        self.dropout = Dropout(dropout)
        self.d_out = d_out

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        return self.conv2(self.dropout(torch.relu(self.conv1(x, edge_index))), edge_index)

    def num_values(self) -> int:
        return sum(p.numel() for p in self.parameters())


class NeighGen(nn.Module):
    """NeighGen: a SAGE encoder, dGen (degree regressor) and fGen (the released widths, no
    final tanh: bank states are unbounded)."""

    def __init__(self, d: int, latent: int = 128, num_pred: int = 5) -> None:
        super().__init__()
        self.d, self.num_pred = d, num_pred
        self.enc = SageLayer(d, latent)
        self.dgen = nn.Linear(latent, 1)
        self.fgen = nn.Sequential(
            nn.Linear(latent, 256), nn.ReLU(), nn.Linear(256, 2048), nn.ReLU(),
            nn.Linear(2048, num_pred * d),
        )  # fmt: skip

    def forward(
        self, x: Tensor, edge_index: Tensor, rows: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Predicted missing degree [N] and generated features [N or len(rows), num_pred, d]."""
        h = torch.relu(self.enc(x, edge_index))
        g = h if rows is None else h[rows]
        return self.dgen(h).squeeze(-1), self.fgen(g).view(-1, self.num_pred, self.d)

    def num_values(self) -> int:
        return sum(p.numel() for p in self.parameters())


def impair(
    edge_index: Tensor, nodes: Tensor, num_nodes: int, hide: float, generator: torch.Generator
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(kept, hidden, impaired edges, missing [2, M] (kept, hidden neighbour))`` with a
    seeded ``hide`` of ``nodes`` hidden."""
    perm = nodes[torch.randperm(len(nodes), generator=generator)]
    n_hide = int(round(hide * len(nodes)))
    hidden, kept = perm[:n_hide].sort().values, perm[n_hide:].sort().values
    is_hidden = torch.zeros(num_nodes, dtype=torch.bool)
    is_hidden[hidden] = True
    src, dst = edge_index
    keep = ~is_hidden[src] & ~is_hidden[dst]
    miss = ~is_hidden[src] & is_hidden[dst]
    return kept, hidden, edge_index[:, keep], edge_index[:, miss]


def relabel(edge_index: Tensor, nodes: Tensor, num_nodes: int) -> Tensor:
    """``edge_index`` (between ``nodes`` only) renumbered to positions in ``nodes``."""
    pos = torch.full((num_nodes,), -1, dtype=torch.long)
    pos[nodes] = torch.arange(len(nodes))
    return pos[edge_index]


def local_batch(x: Tensor, kept: Tensor, impaired: Tensor, missing: Tensor) -> dict[str, Tensor]:
    """NeighGen's batch on the kept nodes only, renumbered, with the hidden neighbours'
    inputs as ``targets``: the losses equal those on the whole graph."""
    hidden = torch.unique(missing[1])
    miss = torch.stack(
        [relabel(missing[0], kept, x.size(0)), relabel(missing[1], hidden, x.size(0))]
    )
    return {
        "x": x[kept], "impaired": relabel(impaired, kept, x.size(0)),
        "kept": torch.arange(len(kept)), "missing": miss, "targets": x[hidden],
    }  # fmt: skip


def degree_loss(pred: Tensor, missing: Tensor, kept: Tensor, num_pred: int) -> Tensor:
    """``L_deg``: smooth-L1 to each kept node's hidden-neighbour count (capped at ``num_pred``)."""
    true = torch.bincount(missing[0], minlength=pred.size(0)).float().clamp(max=num_pred)
    return F.smooth_l1_loss(pred[kept], true[kept])


def greedy_feature_loss(gen: Tensor, x: Tensor, missing: Tensor, kept: Tensor) -> Tensor:
    """``L_feat``, FedSage+'s greedy L2: each of a node's first ``min(n_v, P)`` generated
    features takes its nearest hidden neighbour's squared distance; mean over ``kept``."""
    p = gen.size(1)
    total = gen.new_zeros(())
    if missing.size(1) == 0:
        return total
    d2 = ((gen[missing[0]] - x[missing[1]].unsqueeze(1)) ** 2).sum(-1)  # [M, P]
    best = torch.full((gen.size(0), p), float("inf"), dtype=gen.dtype)
    best = best.scatter_reduce(0, missing[0].unsqueeze(1).expand(-1, p), d2, "amin")
    count = torch.bincount(missing[0], minlength=gen.size(0)).clamp(max=p)
    use = torch.arange(p).unsqueeze(0) < count.unsqueeze(1)  # the first min(n_v, P) slots
    return torch.where(use, best, torch.zeros_like(best)).sum() / max(len(kept), 1)


def mend(
    x: Tensor, edge_index: Tensor, nodes: Tensor, degree: Tensor, features: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(x', edge_index', owner)``: each of ``nodes`` gets its rounded predicted number of
    generated neighbours, appended and linked both ways."""
    p = features.size(1)
    n = degree[nodes].round().clamp(0, p).long()
    owner = nodes.repeat_interleave(n)
    slot = torch.arange(len(owner)) - torch.repeat_interleave(n.cumsum(0) - n, n)
    new_x = features[owner, slot]
    new_id = torch.arange(x.size(0), x.size(0) + len(owner))
    links = torch.cat([torch.stack([owner, new_id]), torch.stack([new_id, owner])], 1)
    return torch.cat([x, new_x.to(x.dtype)]), torch.cat([edge_index, links], 1), owner
