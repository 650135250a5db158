"""Seeded client partitions of one graph, saved as a hashed manifest and reused."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedlightning.data.graphs.base import MultimodalGraph, SetupStep
from fedlightning.errors import ConfigError, DataError
from fedlightning.utils.io import ContentHashed, content_hash, write_json
from fedlightning.utils.seeding import derive_seed, torch_generator

log = logging.getLogger(__name__)

TRAIN, VAL, TEST = 0, 1, 2
MIN_CLIENT_NODES = 10
# Above this many nodes, `partition=louvain` partitions with METIS (`large_method`): Louvain
# in networkx takes minutes there (docs/scaling.md).
LARGE_GRAPH_NODES = 50_000


@dataclass
class Partition(ContentHashed):
    """Node-to-client assignment and per-client train/val/test split: a protocol object.

    Args:
        assignment: long ``[N]``, the client of each node.
        split: long ``[N]``, ``0`` train / ``1`` val / ``2`` test inside the node's client.
        meta: the inputs it was built from (method, parameters, seed, graph fingerprint)."""

    assignment: Tensor
    split: Tensor
    meta: dict[str, Any]

    @property
    def num_clients(self) -> int:
        return int(self.meta["num_clients"])

    def to_json(self) -> dict[str, Any]:
        return {**self.meta, "assignment": self.assignment.tolist(), "split": self.split.tolist()}

    def client_nodes(self, k: int) -> Tensor:
        return (self.assignment == k).nonzero().squeeze(1)

    def save(self, path: str | Path) -> None:
        write_json(path, {**self.to_json(), "hash": self.hash}, indent=None)

    @classmethod
    def load(cls, path: str | Path) -> Partition:
        try:
            obj = json.loads(Path(path).read_text())
            assignment = torch.tensor(obj.pop("assignment"), dtype=torch.long)
            split = torch.tensor(obj.pop("split"), dtype=torch.long)
            stored = obj.pop("hash")
        except (OSError, ValueError, KeyError) as e:
            raise DataError(path, f"not a readable partition manifest ({e})") from e
        part = cls(assignment, split, obj)
        if part.hash != stored:
            raise DataError(
                path, f"field `hash`: stored {stored} but content hashes to {part.hash}"
            )
        return part


def check_trainable(partition: Partition, y: Tensor, name: str) -> None:
    """Refuse, before any training, a partition of graph ``name`` (labels ``y``) that a node
    classifier cannot learn from: a client without training nodes (its loss would be
    undefined), or fewer than two classes among all training nodes (every prediction would
    be right: accuracy 1.0 that means nothing)."""
    train = partition.split == TRAIN
    per_client = torch.bincount(partition.assignment[train], minlength=partition.num_clients)
    empty = (per_client == 0).nonzero().flatten().tolist()
    if empty:
        k = empty[0]
        size = int((partition.assignment == k).sum())
        raise ConfigError(
            "partition.split",
            f"client {k} of {partition.num_clients} gets no training node of {name!r} "
            f"({size} nodes, split {partition.meta['split_fractions']}); raise the training "
            "fraction or use fewer clients",
        )
    classes = sorted(y[train].unique().tolist())
    if len(classes) < 2:
        raise ConfigError(
            "dataset",
            f"{name!r} has {len(classes)} class among its training nodes ({classes}); node "
            "classification needs at least 2 (one class scores accuracy 1.0 for nothing)",
        )


def merge_communities(communities: list[list[int]], num_clients: int) -> list[int]:
    """The client of each node: communities, largest first, each merged into the currently
    smallest of ``num_clients`` clients (ties: lowest index), as in FedSage+ and FED-PUB."""
    sizes = [0] * num_clients
    num_nodes = sum(len(c) for c in communities)
    owner = [-1] * num_nodes
    order = sorted(communities, key=lambda c: (-len(c), min(c)))
    for comm in order:
        k = min(range(num_clients), key=lambda j: (sizes[j], j))
        for v in comm:
            owner[v] = k
        sizes[k] += len(comm)
    return owner


def client_splits(assignment: Tensor, fractions: tuple[float, float, float], seed: int) -> Tensor:
    """Client ``k`` permutes its nodes with a generator seeded by ``(seed, "split", k)`` and
    takes the first ``round(f_train n)`` for training, the next ``round(f_val n)`` for
    validation, the rest for test."""
    split = torch.full_like(assignment, TEST)
    clients = assignment.unique().tolist()
    quiet = assignment.numel() <= LARGE_GRAPH_NODES
    with SetupStep("client splits", len(clients), "client", quiet=quiet) as step:
        for k in clients:
            _split_client(split, assignment, k, fractions, seed)
            step.update()
    return split


def _split_client(
    split: Tensor, assignment: Tensor, k: int, fractions: tuple[float, float, float], seed: int
) -> None:
    """Client ``k``'s part of :func:`client_splits`, written into ``split``."""
    nodes = (assignment == k).nonzero().squeeze(1)
    perm = nodes[torch.randperm(nodes.numel(), generator=torch_generator(seed, "split", k))]
    n_tr = round(fractions[0] * nodes.numel())
    n_va = round(fractions[1] * nodes.numel())
    split[perm[:n_tr]] = TRAIN
    split[perm[n_tr : n_tr + n_va]] = VAL


class Partitioner:
    """Base: builds a :class:`Partition` with train/val/test fractions ``split`` inside each
    client, cached under ``cache_dir`` (``None``: not cached) by the hash of its inputs."""

    method = "base"
    param_names: tuple[str, ...] = ()  # the attributes that are the manifest's `params`

    def __init__(
        self, split: tuple[float, float, float] = (0.6, 0.2, 0.2), cache_dir: str | None = None
    ) -> None:
        split = tuple(float(x) for x in split)
        if len(split) != 3 or min(split) < 0 or abs(sum(split) - 1.0) > 1e-6:
            raise ConfigError(
                "partition.split", f"three non-negative fractions summing to 1, got {list(split)}"
            )
        self.split = split
        self.cache_dir = Path(cache_dir) if cache_dir else None

    def params(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.param_names}

    def assign(self, graph: MultimodalGraph, num_clients: int, seed: int) -> list[int]:
        raise NotImplementedError

    def __call__(self, graph: MultimodalGraph, num_clients: int, seed: int) -> Partition:
        if num_clients < 1:
            raise ConfigError("federation.clients", f"must be >= 1, got {num_clients}")
        if num_clients * MIN_CLIENT_NODES > graph.num_nodes:
            raise ConfigError(
                "federation.clients",
                f"{num_clients} clients need at least "
                f"{num_clients * MIN_CLIENT_NODES} nodes ({MIN_CLIENT_NODES} each); "
                f"graph {graph.name!r} has {graph.num_nodes}",
            )
        meta = {
            "method": self.method,
            "params": self.params(),
            "num_clients": int(num_clients),
            "seed": int(seed),
            "split_fractions": list(self.split),
            "graph": graph.fingerprint(),
            "num_nodes": graph.num_nodes,
        }
        cached = self.cache_dir / f"partition-{content_hash(meta)}.json" if self.cache_dir else None
        if cached is not None and cached.exists():
            part = Partition.load(cached)
            if part.meta == meta:
                log.info("partition: reusing %s (hash %s)", cached, part.hash)
                return part
        assignment = torch.tensor(self.assign(graph, num_clients, seed), dtype=torch.long)
        sizes = torch.bincount(assignment, minlength=num_clients)
        if int(sizes.min()) < MIN_CLIENT_NODES:
            raise ConfigError(
                "federation.clients",
                f"{self.method} partition of {graph.name!r} into "
                f"{num_clients} clients leaves a client with {int(sizes.min())} nodes "
                f"(< {MIN_CLIENT_NODES}); use fewer clients",
            )
        part = Partition(assignment, client_splits(assignment, self.split, seed), meta)
        if cached is not None:
            part.save(cached)
        return part


def metis_assignment(graph: MultimodalGraph, num_clients: int, seed: int) -> np.ndarray:
    """The client of each node: METIS (``pymetis``) cuts the graph into ``num_clients``
    parts of near-equal size with few edges between them; its random choices are seeded by
    ``(seed, "metis")``, so the same graph and seed give the same parts. It bisects
    recursively: half the time of the k-way method on a 100k-node, 2M-edge block graph
    (12.0 s against 23.0 s on a loaded machine), the same share of edges cut there."""
    try:
        import pymetis
    except ImportError:
        raise ConfigError(
            "partition", "METIS needs pymetis (a dependency of fedlightning): pip install pymetis"
        ) from None
    n = graph.num_nodes
    src, dst = graph.edge_index  # coalesced: sorted by source, so it is the CSR order
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(src.numpy(), minlength=n), out=starts[1:])
    options = pymetis.Options(seed=derive_seed(seed, "metis") % 2**31)
    adjacency = pymetis.CSRAdjacency(adj_starts=starts, adjacent=dst.numpy())
    with SetupStep("partition (METIS)", n, "node", quiet=n <= LARGE_GRAPH_NODES) as step:
        _, parts = pymetis.part_graph(num_clients, adjacency, options=options, recursive=True)
        step.update(n)
    return np.asarray(parts, dtype=np.int64)


class MetisPartitioner(Partitioner):
    """METIS parts (:func:`metis_assignment`): K balanced clients with few edges between
    them, in seconds on a million nodes."""

    method = "metis"

    def assign(self, graph: MultimodalGraph, num_clients: int, seed: int) -> list[int]:
        return metis_assignment(graph, num_clients, seed).tolist()


class LouvainPartitioner(Partitioner):
    """Louvain communities (networkx, seeded; ``resolution``) merged into K clients by size.

    A graph of more than ``large_above`` nodes (default :data:`LARGE_GRAPH_NODES`) is
    partitioned by ``large_method`` instead: ``"metis"`` (default; :class:`MetisPartitioner`)
    or ``"louvain"``; the manifest's ``method`` says which made it."""

    method = "louvain"
    param_names = ("resolution",)

    def __init__(
        self,
        resolution: float = 1.0,
        large_method: str = "metis",
        large_above: int = LARGE_GRAPH_NODES,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        if large_method not in ("metis", "louvain"):
            raise ConfigError(
                "partition.large_method", f"expected 'metis' or 'louvain', got {large_method!r}"
            )
        self.resolution = float(resolution)
        self.large_method, self.large_above = large_method, int(large_above)

    def __call__(self, graph: MultimodalGraph, num_clients: int, seed: int) -> Partition:
        if self.large_method == "metis" and graph.num_nodes > self.large_above:
            log.info(
                "partition: %d nodes > %d, METIS instead of Louvain "
                "(partition.large_method=louvain keeps Louvain: minutes)",
                graph.num_nodes,
                self.large_above,
            )
            return MetisPartitioner(self.split, self.cache_dir)(graph, num_clients, seed)
        return super().__call__(graph, num_clients, seed)

    def assign(self, graph: MultimodalGraph, num_clients: int, seed: int) -> list[int]:
        import networkx as nx  # only the Louvain partitioner needs it

        g = nx.Graph()
        g.add_nodes_from(range(graph.num_nodes))
        g.add_edges_from(graph.edge_index.t().tolist())
        comms = nx.community.louvain_communities(
            g, resolution=self.resolution, seed=derive_seed(seed, "louvain") % 2**32
        )
        comms = [sorted(c) for c in comms]
        if len(comms) < num_clients:
            raise ConfigError(
                "federation.clients",
                f"Louvain finds {len(comms)} communities in "
                f"{graph.name!r}, fewer than the {num_clients} clients asked for",
            )
        return merge_communities(comms, num_clients)


class RandomPartitioner(Partitioner):
    """Nodes dealt to K clients by a seeded permutation (sizes differ by at most one)."""

    method = "random"

    def assign(self, graph: MultimodalGraph, num_clients: int, seed: int) -> list[int]:
        perm = np.random.default_rng(derive_seed(seed, "random_partition")).permutation(
            graph.num_nodes
        )
        owner = np.empty(graph.num_nodes, dtype=np.int64)
        owner[perm] = np.arange(graph.num_nodes) % num_clients
        return owner.tolist()


def fill_small_clients(owner: np.ndarray, y: np.ndarray, num_clients: int, minimum: int) -> None:
    """Give every client at least ``minimum`` nodes, in place (needs ``N >= minimum x K``):
    while a client holds fewer, the smallest client (ties: lowest index) receives from the
    largest (ties: lowest index) the highest-numbered node of its most frequent class (ties:
    lowest class id). The donor then holds more than ``minimum``, so the loop ends."""
    sizes = np.bincount(owner, minlength=num_clients)
    while sizes.min() < minimum:
        k = int(np.argmin(sizes))
        donor = int(np.argmax(sizes))
        theirs = np.flatnonzero(owner == donor)
        cls = int(np.argmax(np.bincount(y[theirs])))
        v = int(theirs[y[theirs] == cls].max())
        owner[v] = k
        sizes[donor] -= 1
        sizes[k] += 1


class DirichletPartitioner(Partitioner):
    r"""Label skew: for each class :math:`c = 0, 1, \dots` in turn, one generator seeded by
    ``(seed, "dirichlet_partition")`` draws shares :math:`q_c \sim \mathrm{Dir}(\alpha
    \mathbf{1}_K)` (``alpha > 0``) and a permutation of the class's nodes, cut at
    ``round(cumsum(q_c) x n_c)``: client ``k`` gets the ``k``-th piece. Then
    :func:`fill_small_clients` brings every client to ``MIN_CLIENT_NODES``."""

    method = "dirichlet"
    param_names = ("alpha",)

    def __init__(self, alpha: float = 0.5, **kw: Any) -> None:
        super().__init__(**kw)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise ConfigError("partition.alpha", f"must be a number > 0, got {alpha!r}")
        if not (np.isfinite(alpha) and alpha > 0):
            raise ConfigError("partition.alpha", f"must be a finite number > 0, got {alpha}")
        self.alpha = float(alpha)

    def assign(self, graph: MultimodalGraph, num_clients: int, seed: int) -> list[int]:
        rng = np.random.default_rng(derive_seed(seed, "dirichlet_partition"))
        y = graph.y.numpy().astype(np.int64)
        owner = np.zeros(graph.num_nodes, dtype=np.int64)
        for c in range(graph.num_classes):
            nodes = np.flatnonzero(y == c)
            shares = rng.dirichlet(np.full(num_clients, self.alpha))
            perm = rng.permutation(nodes)
            cuts = np.round(np.cumsum(shares)[:-1] * nodes.size).astype(np.int64)
            for k, piece in enumerate(np.split(perm, cuts)):
                owner[piece] = k
        fill_small_clients(owner, y, num_clients, MIN_CLIENT_NODES)
        return owner.tolist()
