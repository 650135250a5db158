"""The typed multimodal attributed graph every loader returns."""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor
from torch_geometric.data import Data
from torch_geometric.utils import subgraph
from tqdm.auto import tqdm

log = logging.getLogger("fedlightning.data")

# Sparse modalities are built from valid tensors' entries: torch's default (no invariant
# checks), said explicitly, so torch does not warn that it is implicit.
torch.sparse.check_sparse_tensor_invariants.disable()


@dataclass
class MultimodalGraph:
    r"""A graph whose nodes carry one feature matrix per named modality.

    Args:
        name: dataset name, e.g. ``"cora"``.
        features: modality name -> float32 matrix of shape ``[N, d_m]``, dense or torch
            sparse COO (a bag-of-words modality stays sparse). Rows of a missing modality are
            zero (absent from a sparse one), and ``mask`` says they are missing.
        mask: bool ``[N, M]``: ``mask[i, m]`` is True when node ``i`` has modality
            ``modalities[m]``.
        edge_index: long ``[2, E]``, undirected (both directions), coalesced, no self loops.
        y: long ``[N]`` class labels in ``0..C-1``.
        class_names: the ``C`` class names, in label order.
        node_ids: optional original node identifiers (e.g. paper ids), length ``N``."""

    name: str
    features: dict[str, Tensor]
    mask: Tensor
    edge_index: Tensor
    y: Tensor
    class_names: list[str]
    node_ids: list[str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        n = self.y.numel()
        if not self.features:
            raise ValueError(f"graph {self.name!r}: at least one modality is required")
        for m, x in self.features.items():
            if x.layout not in (torch.strided, torch.sparse_coo):
                raise ValueError(f"graph {self.name!r}: modality {m!r} must be dense or sparse COO")
            if x.dim() != 2 or x.size(0) != n:
                raise ValueError(
                    f"graph {self.name!r}: modality {m!r} has shape "
                    f"{tuple(x.shape)}, expected [{n}, d]"
                )
        if tuple(self.mask.shape) != (n, len(self.features)):
            raise ValueError(
                f"graph {self.name!r}: mask has shape {tuple(self.mask.shape)}, "
                f"expected [{n}, {len(self.features)}]"
            )
        if self.edge_index.numel() and int(self.edge_index.max()) >= n:
            raise ValueError(
                f"graph {self.name!r}: edge_index refers to node "
                f"{int(self.edge_index.max())} but there are {n} nodes"
            )
        if n and (int(self.y.min()) < 0 or int(self.y.max()) >= len(self.class_names)):
            raise ValueError(
                f"graph {self.name!r}: labels must lie in 0..{len(self.class_names) - 1}"
            )

    @property
    def modalities(self) -> list[str]:
        return list(self.features)

    @property
    def num_nodes(self) -> int:
        return self.y.numel()

    @property
    def num_edges(self) -> int:
        """Number of undirected edges."""
        return self.edge_index.size(1) // 2

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def subgraph(self, nodes: Tensor) -> MultimodalGraph:
        """The subgraph induced on ``nodes`` (sorted long indices), relabelled to 0..n-1."""
        nodes = nodes.sort().values
        ei, _ = subgraph(nodes, self.edge_index, relabel_nodes=True, num_nodes=self.num_nodes)
        return MultimodalGraph(
            name=self.name,
            features={m: x.index_select(0, nodes) for m, x in self.features.items()},
            mask=self.mask[nodes],
            edge_index=ei,
            y=self.y[nodes],
            class_names=list(self.class_names),
            node_ids=None if self.node_ids is None else [self.node_ids[i] for i in nodes.tolist()],
        )

    def split(self, assignment: Tensor, parts: int, release: bool = False) -> list[MultimodalGraph]:
        """``[self.subgraph(nodes of part k) for k in range(parts)]`` (``assignment[i]``: the
        part of node ``i``; other values belong to no part), with the same values, in one
        pass over the edges instead of one per part; each dense modality is gathered once,
        part ``k``'s rows adjacent views of that one tensor (a stacked union of the parts
        in order is then a view, no copy: ``fedlightning.models.stacked.joined_rows``).
        ``release``: this graph's dense modalities are dropped from it as they are
        gathered (for a caller that reads them no more: one modality's two copies at a
        time, not every modality's)."""
        assignment = assignment.long()
        valid = (assignment >= 0) & (assignment < parts)
        part = torch.where(valid, assignment, parts)  # the rest last, then dropped
        order = torch.argsort(part, stable=True)  # part 0's nodes ascending, part 1's, ...
        counts = torch.bincount(part, minlength=parts + 1)[:parts]
        starts = torch.cumsum(counts, 0) - counts
        order = order[: int(counts.sum())]
        local = torch.full((self.num_nodes,), -1, dtype=torch.long)
        local[order] = torch.arange(order.numel()) - starts.repeat_interleave(counts)
        src, dst = self.edge_index
        inside = (part[src] == part[dst]) & valid[src]
        src, dst = src[inside], dst[inside]
        by_part = torch.argsort(part[src], stable=True)  # each part's edges in their order
        edge_counts = torch.bincount(part[src], minlength=parts)[:parts].tolist()
        edges = torch.stack([local[src[by_part]], local[dst[by_part]]])
        names, dense = list(self.features), {}
        for m in [m for m in names if self.features[m].layout == torch.strided]:
            dense[m] = self.features[m].index_select(0, order).split(counts.tolist())
            if release:
                del self.features[m]
        out, at = [], 0
        for k, nodes in enumerate(order.split(counts.tolist())):
            e = edge_counts[k]
            feats = {
                m: dense[m][k] if m in dense else self.features[m].index_select(0, nodes)
                for m in names
            }
            out.append(
                MultimodalGraph(
                    name=self.name,
                    features=feats,
                    mask=self.mask[nodes],
                    edge_index=edges[:, at : at + e].contiguous(),
                    y=self.y[nodes],
                    class_names=list(self.class_names),
                    node_ids=None
                    if self.node_ids is None
                    else [self.node_ids[i] for i in nodes.tolist()],
                )
            )
            at += e
        return out

    def to_data(self) -> Data:
        """A PyG ``Data`` with ``x_<modality>`` attributes, ``modality_mask``, ``edge_index``, ``y``."""
        feats = {f"x_{m}": x for m, x in self.features.items()}
        data = Data(edge_index=self.edge_index, y=self.y, num_nodes=self.num_nodes, **feats)
        data.modality_mask = self.mask
        return data

    def fingerprint(self) -> str:
        """A content hash of the structure and labels (sha256 hex, first 16 chars)."""
        h = hashlib.sha256()
        h.update(self.name.encode())
        h.update(str(self.num_nodes).encode())
        h.update(self.edge_index.contiguous().numpy().tobytes())
        h.update(self.y.numpy().tobytes())
        for m, x in self.features.items():
            h.update(m.encode())
            h.update(str(tuple(x.shape)).encode())
        return h.hexdigest()[:16]

    def __repr__(self) -> str:
        mods = ", ".join(f"{m}={x.size(1)}" for m, x in self.features.items())
        return (
            f"MultimodalGraph({self.name}, nodes={self.num_nodes}, edges={self.num_edges}, "
            f"classes={self.num_classes}, modalities=[{mods}])"
        )


def clean_edges(edge_index: Tensor, num_nodes: int) -> Tensor:
    """Make an edge list undirected, coalesced (sorted by source, then target; no
    duplicates) and free of self loops: PyG's ``to_undirected`` and ``coalesce``'s result,
    with one sort of the edges' keys ``source * N + target`` instead of their several."""
    src, dst = edge_index.long()
    keep = src != dst
    src, dst = src[keep], dst[keep]
    n = max(int(num_nodes), 1)
    keys = torch.unique(torch.cat([src * n + dst, dst * n + src]), sorted=True)
    return torch.stack([keys // n, keys % n])


def full_mask(num_nodes: int, num_modalities: int) -> Tensor:
    """An availability mask in which every node has every modality."""
    return torch.ones(num_nodes, num_modalities, dtype=torch.bool)


def apply_missing(
    graph: MultimodalGraph, rate: float | dict[str, float], seed: int, inplace: bool = False
) -> MultimodalGraph:
    r"""Hide each modality for a fraction ``rate`` of the nodes, seeded.

    A node keeps at least one modality: where all of a node's modalities would be hidden,
    the one with the lowest draw stays. Hidden rows are zeroed and ``mask`` is False there.

    Args:
        rate: one rate for all modalities, or a rate per modality name (missing names: 0).
        seed: the protocol seed.
        inplace: zero a dense modality's hidden rows in its own tensor (the same values,
            without a second copy of the features; for a graph nothing else holds)."""
    rates = [float(rate.get(m, 0.0) if isinstance(rate, dict) else rate) for m in graph.modalities]
    if all(r == 0.0 for r in rates):
        return graph
    gen = torch.Generator().manual_seed(int(seed))
    draws = torch.rand(graph.num_nodes, len(rates), generator=gen)
    hide = draws < torch.tensor(rates)
    all_hidden = hide.all(dim=1)
    if all_hidden.any():
        keep = draws[all_hidden].argmin(dim=1)
        hide[all_hidden.nonzero().squeeze(1), keep] = False
    mask = graph.mask & ~hide
    return replace(graph, features=zero_missing(graph.features, mask, inplace), mask=mask)


def zero_missing(
    features: dict[str, Tensor], mask: Tensor, inplace: bool = False
) -> dict[str, Tensor]:
    """Each modality with the rows ``mask`` marks unavailable zeroed (``mask[:, j]`` is
    modality ``j``'s); a sparse modality drops their entries, so no model reads a value
    that "is not there". ``inplace``: a dense modality is multiplied in its own tensor."""
    out = {}
    for j, (m, x) in enumerate(features.items()):
        if x.layout == torch.sparse_coo:
            x = x.coalesce()
            kept = mask[x.indices()[0], j]
            index, values = x.indices()[:, kept], x.values()[kept]
            x = torch.sparse_coo_tensor(index, values, x.shape, is_coalesced=True)
        else:
            keep = mask[:, j : j + 1].to(x.dtype)
            x = x.mul_(keep) if inplace else x * keep
        out[m] = x
    return out


# The progress of one long set-up step (a large graph's edges, its partition, its splits).
class SetupStep:
    """One set-up step over ``total`` pieces of ``unit``: an INFO line when it starts, a tqdm
    bar on an interactive terminal only, and an INFO line with the count and the seconds
    when it ends (:meth:`close`). Use as a context manager, or call :meth:`close`.

    Args:
        name: the step's name, e.g. ``"graph edges"``.
        total: the number of pieces the step does.
        unit: what a piece is, e.g. ``"block"``, ``"client"``.
        quiet: a step known to be short (a small graph): its lines at DEBUG, no bar."""

    def __init__(self, name: str, total: int, unit: str, quiet: bool = False) -> None:
        self.name, self.total, self.unit, self.done = name, int(total), unit, 0
        self.level = logging.DEBUG if quiet else logging.INFO
        self.t0 = time.perf_counter()
        log.log(self.level, "%s: %d %ss", name, self.total, unit)
        disable = True if quiet else None  # None: a bar on an interactive terminal only
        self.bar = tqdm(total=self.total, desc=name, unit=unit, disable=disable, leave=False)

    def update(self, n: int = 1) -> None:
        self.done += n
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()
        seconds = time.perf_counter() - self.t0
        log.log(self.level, "%s done: %d %ss in %.1fs", self.name, self.done, self.unit, seconds)

    def __enter__(self) -> SetupStep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
