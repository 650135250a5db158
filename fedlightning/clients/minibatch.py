"""Mini-batch clients: a client whose graph has more nodes than ``federation.minibatch``'s
``budget_nodes`` trains by neighbour-sampled mini-batches, and is evaluated (and its
FedOGL prototypes and bases computed) by batched full-neighbourhood inference
(docs/scaling.md, "Mini-batch clients"). A graph within the budget keeps the full-batch
step, bit for bit.

The sampler is GraphSAGE's (Hamilton et al., 2017, Alg. 2), as PyG's ``NeighborLoader``
samples without ``pyg-lib`` or ``torch-sparse`` (neither is a dependency, and PyG's own
loader needs one of them): from a batch of seed nodes, ``fanout[h]`` in-neighbours of
every node of hop ``h`` drawn uniformly without replacement (all of them where it has
fewer, or where ``fanout[h] = -1``); the mini-batch is the graph of the sampled edges
(directed towards the seeds), its seed nodes first. The loss reads only the seeds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch_geometric.data import Data

from fedlightning.config import check_minibatch
from fedlightning.models.constant import kept

INFERENCE_SEED = 0  # a sampled inference (``inference_fanout``) draws from its own generator


@dataclass(frozen=True)
class MiniBatch:
    """``federation.minibatch``: a graph of more than ``budget_nodes`` nodes trains by
    mini-batches of ``batch_size`` seed nodes with ``fanout`` in-neighbours per hop (one
    entry per GNN layer; ``-1``: all); inference runs over batches of
    ``inference_batch_size`` nodes, with every neighbour over ``len(fanout) + 1`` hops
    (``inference_fanout=None``: exact for GCN and SAGE layers, the extra hop gives the
    last hop's nodes their whole degree for GCN's normalisation) or ``inference_fanout``."""

    budget_nodes: int = 200_000
    batch_size: int = 1024
    fanout: tuple[int, ...] = (10, 10)
    inference_batch_size: int = 4096
    inference_fanout: tuple[int, ...] | None = None

    @classmethod
    def from_config(cls, value: Any) -> MiniBatch | None:
        """The checked setting (:func:`~fedlightning.config.check_minibatch`), or ``None``."""
        v = check_minibatch(value)
        if v is None:
            return None
        inf = v["inference_fanout"]
        return cls(
            v["budget_nodes"],
            v["batch_size"],
            tuple(v["fanout"]),
            v["inference_batch_size"],
            None if inf is None else tuple(inf),
        )

    def applies(self, data: Any) -> bool:
        """Whether ``data`` exceeds the budget (then it trains by mini-batches)."""
        return int(data.num_nodes) > self.budget_nodes

    @property
    def inference_hops(self) -> tuple[int, ...]:
        return self.inference_fanout or (-1,) * (len(self.fanout) + 1)


def applies(setting: MiniBatch | None, data: Any) -> bool:
    """Whether ``setting`` (``None``: off) sends ``data`` to mini-batches."""
    return setting is not None and setting.applies(data)


def in_csc(edge_index: Tensor, num_nodes: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(ptr, sources, edge ids)``: the in-edges of node ``i`` are ``sources[ptr[i]:ptr[i +
    1]]`` (edge ids in ``edge_index`` alongside), kept per edge tensor."""

    def build() -> tuple[Tensor, Tensor, Tensor]:
        perm = torch.argsort(edge_index[1], stable=True)
        counts = torch.bincount(edge_index[1], minlength=num_nodes)
        ptr = torch.zeros(num_nodes + 1, dtype=torch.long)
        ptr[1:] = torch.cumsum(counts, 0)
        return ptr, edge_index[0, perm], perm

    return kept(edge_index, ("in_csc", num_nodes), build)


def sample_hop(
    ptr: Tensor, sources: Tensor, frontier: Tensor, k: int, gen: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """``(positions in the CSC, frontier position of each)``: up to ``k`` in-edges of each
    ``frontier`` node, uniformly without replacement (all of them for ``k = -1`` or a node
    of degree at most ``k``)."""
    start, deg = ptr[frontier], ptr[frontier + 1] - ptr[frontier]
    seg = torch.repeat_interleave(torch.arange(frontier.numel()), deg)
    offset = torch.cumsum(deg, 0) - deg
    pos = start[seg] + torch.arange(seg.numel()) - offset[seg]
    if k < 0 or seg.numel() == 0:
        return pos, seg
    order = torch.argsort(torch.rand(seg.numel(), generator=gen))  # random ranks ...
    order = order[torch.argsort(seg[order], stable=True)]  # ... within each node's edges
    keep = (torch.arange(seg.numel()) - offset[seg[order]]) < k
    return pos[order[keep]], seg[order[keep]]


def sample_subgraph(
    data: Data, seeds: Tensor, fanout: Sequence[int], gen: torch.Generator | None = None
) -> Data:
    """The mini-batch of ``seeds`` (:mod:`this module <fedlightning.clients.minibatch>`):
    the sampled nodes' rows of every node attribute of ``data``, seeds first, the sampled
    edges relabelled (their other edge attributes alongside), ``n_id`` (the nodes in
    ``data``) and ``batch_size`` (the number of seeds)."""
    n = int(data.num_nodes)
    ptr, sources, eid = in_csc(data.edge_index, n)
    local = torch.full((n,), -1, dtype=torch.long)
    local[seeds] = torch.arange(seeds.numel())
    n_id, frontier, rows, cols, edges = [seeds], seeds, [], [], []
    count = seeds.numel()
    for k in fanout:
        pos, seg = sample_hop(ptr, sources, frontier, int(k), gen)
        src = sources[pos]
        new = torch.unique(src[local[src] < 0])
        local[new] = torch.arange(count, count + new.numel())
        count += new.numel()
        rows.append(local[src])
        cols.append(local[frontier[seg]])
        edges.append(eid[pos])
        n_id.append(new)
        frontier = new
    nodes = torch.cat(n_id)
    e_id = torch.cat(edges)
    sub = Data()
    for key, value in data.items():
        if key == "edge_index":
            continue
        if isinstance(value, Tensor) and data.is_node_attr(key):
            sub[key] = value.index_select(0, nodes)
        elif isinstance(value, Tensor) and data.is_edge_attr(key):
            sub[key] = value.index_select(0, e_id)
        else:
            sub[key] = value
    sub.edge_index = torch.stack([torch.cat(rows), torch.cat(cols)])
    sub.num_nodes, sub.n_id, sub.batch_size = nodes.numel(), nodes, seeds.numel()
    return sub


def seed_only(sub: Data, masks: Sequence[str]) -> Data:
    """``sub`` with each of ``masks`` (the loss's node masks) true only on its seeds."""
    is_seed = torch.arange(int(sub.num_nodes)) < sub.batch_size
    for m in masks:
        if m in sub:
            sub[m] = sub[m] & is_seed
    return sub


class MiniBatches:
    """One local fit's mini-batches of ``data``: every epoch (each iteration) the ``seeds``
    in a fresh random order cut into batches of ``setting.batch_size``, each sampled with
    ``setting.fanout`` (:func:`sample_subgraph`) and its ``masks`` kept on its seeds
    (:func:`seed_only`); drawn from ``gen``, so a fit seeded alike samples alike."""

    def __init__(
        self,
        data: Data,
        seeds: Tensor,
        setting: MiniBatch,
        masks: Sequence[str],
        gen: torch.Generator,
    ) -> None:
        self.data, self.seeds, self.setting = data, seeds, setting
        self.masks, self.gen = tuple(masks), gen

    def __len__(self) -> int:
        return -(-self.seeds.numel() // self.setting.batch_size)

    def __iter__(self) -> Iterator[Data]:
        order = self.seeds[torch.randperm(self.seeds.numel(), generator=self.gen)]
        for chunk in order.split(self.setting.batch_size):
            sub = sample_subgraph(self.data, chunk, self.setting.fanout, self.gen)
            yield seed_only(sub, self.masks)


def minibatches_for(module: Any, batch: Any) -> Any:
    """What a local fit of ``module`` steps over: ``batch`` itself (full batch), or, when
    ``module.minibatch`` applies to it, its :class:`MiniBatches` over the nodes of the
    module's ``loss_masks``, with a generator seeded from the global RNG (which the fit's
    seed set): the global RNG moves only for a mini-batch fit."""
    setting = getattr(module, "minibatch", None)
    if not isinstance(batch, Data) or not applies(setting, batch):
        return batch
    masks = [m for m in getattr(module, "loss_masks", ("train_mask",)) if m in batch]
    if not masks:
        raise ValueError(f"{type(module).__name__}: the batch has none of its loss masks")
    seeds = torch.stack([batch[m] for m in masks]).any(0).nonzero().view(-1)
    gen = torch.Generator().manual_seed(int(torch.randint(2**62, ())))
    return MiniBatches(batch, seeds, setting, masks, gen)


def node_outputs(
    fn: Callable[[Data], Any],
    data: Data,
    setting: MiniBatch | None,
    nodes: Tensor | None = None,
) -> Any:
    """``fn(data)`` (per-node tensors ``[N, ...]``, or tuples, lists and dicts of them),
    computed whole when ``data`` is within ``setting``'s budget, else in batches of
    ``inference_batch_size`` of ``nodes`` (a mask or indices; ``None``: every node), each
    on its sampled neighbourhood (:attr:`MiniBatch.inference_hops`; every neighbour by
    default, so the rows equal the whole graph's up to float summation order). Rows
    outside ``nodes`` are zero (``False`` for masks). No gradient is kept."""
    if not applies(setting, data):
        return fn(data)
    n = int(data.num_nodes)
    if nodes is None:
        nodes = torch.arange(n)
    elif nodes.dtype == torch.bool:
        nodes = nodes.nonzero().view(-1)
    gen = torch.Generator().manual_seed(INFERENCE_SEED)
    out: Any = None
    with torch.no_grad():
        for chunk in nodes.split(setting.inference_batch_size):
            sub = sample_subgraph(data, chunk, setting.inference_hops, gen)
            part = fn(sub)
            out = _scatter_rows(out, part, chunk, sub.batch_size, n)
    return out if out is not None else fn(data)


def _scatter_rows(out: Any, part: Any, at: Tensor, k: int, n: int) -> Any:
    """``part``'s first ``k`` rows into rows ``at`` of ``out`` (built ``[n, ...]`` on first
    use), through tuples, lists and dicts alike."""
    if isinstance(part, Tensor):
        if out is None:
            out = part.new_zeros((n, *part.shape[1:]))
        out[at] = part[:k]
        return out
    if isinstance(part, dict):
        out = out or {}
        return {key: _scatter_rows(out.get(key), v, at, k, n) for key, v in part.items()}
    if isinstance(part, (tuple, list)):
        out = out or [None] * len(part)
        return type(part)(_scatter_rows(o, v, at, k, n) for o, v in zip(out, part, strict=True))
    return part
