"""Partitioners side by side on one large synthetic graph: seconds, parts, and how the parts
follow the classes.

The graph is ``dataset=synthetic_20k`` at ``--nodes`` nodes in 10 classes with its own edge
probabilities (``p_in = 0.0021``, ``p_out = 0.00023`` at 100k nodes: ~2.1M edges, half of
them between classes), drawn by the per-block sampler. Each partitioner runs on the same
graph (``--methods``; one missing its package is skipped):

- ``metis``: METIS from ``pymetis`` (what ``partition=metis`` and, above 50k nodes,
  ``partition=louvain`` use), ``--clients`` parts, seeded;
- ``igraph_louvain``: igraph's multilevel (Louvain) communities, seeded through Python's
  ``random`` (igraph's own C generator cannot be seeded);
- ``leidenalg``: Leiden, modularity, seeded (``leidenalg``);
- ``networkx``: networkx's Louvain (``partition=louvain`` below 50k nodes; minutes at 100k).

For each: the seconds (the graph's conversion to the library's format apart), the number of
parts, their purity (the share of nodes in their part's majority class) and the share of
edges cut.

    python benchmarks/partitioners.py [--nodes 100000] [--clients 10]
        [--methods metis igraph_louvain leidenalg networkx]
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from fedlightning.data.graphs import make_synthetic
from fedlightning.data.partition import metis_assignment


def parts_of(method: str, graph, clients: int) -> tuple[np.ndarray, float, float]:
    """``(part of each node, seconds converting, seconds partitioning)``."""
    ei = graph.edge_index
    pairs = ei[:, ei[0] < ei[1]].t().tolist()
    t = time.perf_counter()
    if method == "metis":
        return metis_assignment(graph, clients, seed=0), 0.0, time.perf_counter() - t
    if method == "networkx":
        import networkx as nx

        g = nx.Graph()
        g.add_nodes_from(range(graph.num_nodes))
        g.add_edges_from(pairs)
        built = time.perf_counter() - t
        t = time.perf_counter()
        comms = nx.community.louvain_communities(g, seed=0)
        owner = np.empty(graph.num_nodes, dtype=np.int64)
        for k, c in enumerate(comms):
            owner[list(c)] = k
        return owner, built, time.perf_counter() - t
    import igraph as ig

    g = ig.Graph(n=graph.num_nodes, edges=pairs)
    built = time.perf_counter() - t
    t = time.perf_counter()
    if method == "igraph_louvain":
        ig.set_random_number_generator(random.Random(0))
        owner = g.community_multilevel().membership
    else:
        import leidenalg

        owner = leidenalg.find_partition(g, leidenalg.ModularityVertexPartition, seed=0).membership
    return np.asarray(owner), built, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument(
        "--methods", nargs="+", default=["metis", "igraph_louvain", "leidenalg", "networkx"]
    )
    args = ap.parse_args()
    scale = 100_000 / args.nodes
    graph = make_synthetic(
        num_nodes=args.nodes,
        num_classes=10,
        modalities={"text": 1},
        p_in=0.0021 * scale,
        p_out=0.00023 * scale,
        seed=0,
        sampler="blocks",
    )
    print(graph, flush=True)
    y = graph.y.numpy()
    src, dst = graph.edge_index.numpy()
    print(
        f"{'method':<16} {'convert s':>9} {'partition s':>11} {'parts':>6} {'purity':>7} {'cut':>6}"
    )
    for method in args.methods:
        try:
            owner, built, seconds = parts_of(method, graph, args.clients)
        except ImportError as e:
            print(f"{method:<16} skipped ({e})")
            continue
        purity = sum(np.bincount(y[owner == k]).max() for k in np.unique(owner)) / y.size
        cut = float((owner[src] != owner[dst]).mean())
        print(
            f"{method:<16} {built:>9.1f} {seconds:>11.1f} {len(np.unique(owner)):>6} "
            f"{purity:>7.3f} {cut:>6.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
