"""A seeded synthetic multimodal graph: stochastic block model + class-dependent features."""

from __future__ import annotations

import numbers
import zlib
from collections.abc import Mapping

import numpy as np
import torch

from fedlightning.data.graphs.base import (
    MultimodalGraph,
    SetupStep,
    apply_missing,
    clean_edges,
    full_mask,
)

__all__ = ["make_synthetic"]

# Upper bound on the number of node pairs drawn at once, so memory stays bounded (~16 MB of
# float32 draws) whatever num_nodes is.
_PAIRS_PER_CHUNK = 1 << 22
# `sampler="auto"` draws edges per block above this many nodes (no shipped config comes near
# it, so their graphs are those of the per-pair sampler) and per pair up to it.
BLOCKS_ABOVE = 50_000
# Up to this many nodes a graph is drawn in about a second: no progress shown.
_QUIET_NODES = 10_000
# Rows of a dense modality drawn (float64) and converted at once: bounds the temporaries.
_ROWS_PER_CHUNK = 1 << 12


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"make_synthetic: {name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _check_float(
    name: str, value: object, low: float, high: float | None = None, high_open: bool = False
) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    v = float(value) if ok else float("nan")
    if (
        not ok
        or not np.isfinite(v)
        or v < low
        or (high is not None and (v > high or (high_open and v == high)))
    ):
        bound = "" if high is None else f" and {'<' if high_open else '<='} {high}"
        raise ValueError(f"make_synthetic: {name} must be a number >= {low}{bound}, got {value!r}")
    return v


def _sbm_edges(y: np.ndarray, p_in: float, p_out: float, rng: np.random.Generator) -> np.ndarray:
    """Draw each unordered pair {i, j} (i < j) once: w.p. p_in within a class, else p_out."""
    n = y.size
    rows_per_chunk = max(1, _PAIRS_PER_CHUNK // max(n, 1))
    cols = np.arange(n)
    src, dst = [], []
    step = SetupStep("graph edges (per pair)", n, "node", quiet=n <= _QUIET_NODES)
    for start in range(0, n, rows_per_chunk):
        rows = np.arange(start, min(start + rows_per_chunk, n))
        step.update(rows.size)
        draws = rng.random((rows.size, n), dtype=np.float32)
        prob = np.where(y[rows, None] == y[None, :], p_in, p_out)
        # Only the upper triangle: each pair is decided once, then mirrored by clean_edges.
        hit = (draws < prob) & (cols[None, :] > rows[:, None])
        r, c = np.nonzero(hit)
        src.append(rows[r])
        dst.append(c)
    step.close()
    return np.stack([np.concatenate(src), np.concatenate(dst)]).astype(np.int64)


def _block_pairs(
    rows: int, cols: int | None, m: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``m`` distinct pairs drawn uniformly: ``(i, j)`` in ``[rows] x [cols]``, or with
    ``cols=None`` unordered pairs ``i < j`` of ``[rows]``. Candidates are drawn in batches
    (an ordered pair, mirrored to ``i < j`` for a diagonal block; ``i == j`` dropped), and
    the first ``m`` distinct ones, in the order drawn, are kept: a uniform ``m``-subset."""
    width = rows if cols is None else cols
    kept = np.empty(0, dtype=np.int64)  # flat ids i * width + j, in the order drawn
    while kept.size < m:
        need = m - kept.size
        batch = need + need // 8 + 16  # a few spare for duplicates and diagonal draws
        i = rng.integers(0, rows, batch)
        j = rng.integers(0, width, batch)
        if cols is None:
            i, j = np.minimum(i, j), np.maximum(i, j)
            keep = i != j
            i, j = i[keep], j[keep]
        flat = i * width + j
        _, first = np.unique(flat, return_index=True)
        flat = flat[np.sort(first)]  # distinct within the batch, in the order drawn
        flat = flat[~np.isin(flat, kept)]
        kept = np.concatenate([kept, flat[:need]])
    return kept // width, kept % width


def _sbm_edges_by_block(
    y: np.ndarray, p_in: float, p_out: float, rng: np.random.Generator
) -> np.ndarray:
    r"""The same stochastic block model as :func:`_sbm_edges`, drawn per block pair: for
    classes :math:`a \le b` the number of edges is
    :math:`m_{ab} \sim \mathrm{Binomial}(P_{ab}, p)` (:math:`P_{aa} = \binom{n_a}{2}`,
    :math:`P_{ab} = n_a n_b`; :math:`p = p_{in}` if :math:`a = b` else :math:`p_{out}`),
    then :math:`m_{ab}` distinct pairs uniformly (:func:`_block_pairs`). Work and memory
    grow with the edges, not with :math:`N^2` (a different draw than :func:`_sbm_edges`')."""
    members = [np.flatnonzero(y == c) for c in range(int(y.max()) + 1)]
    src, dst = [], []
    blocks = len(members) * (len(members) + 1) // 2
    with SetupStep(
        "graph edges (per block)", blocks, "block", quiet=y.size <= _QUIET_NODES
    ) as step:
        for a, rows in enumerate(members):
            for b in range(a, len(members)):
                step.update()
                cols = members[b]
                pairs = rows.size * (rows.size - 1) // 2 if a == b else rows.size * cols.size
                m = int(rng.binomial(pairs, p_in if a == b else p_out)) if pairs else 0
                i, j = _block_pairs(rows.size, None if a == b else cols.size, m, rng)
                src.append(rows[i])
                dst.append(cols[j])
    return np.stack([np.concatenate(src), np.concatenate(dst)]).astype(np.int64)


def _gaussian(
    means: np.ndarray, y: np.ndarray, noise: float, rng: np.random.Generator
) -> torch.Tensor:
    """``float32(means[y] + noise * N(0, I))``, ``[N, d]``, drawn in row chunks: the same
    values as one float64 draw of ``[N, d]`` (the generator fills rows in order), with
    float64 temporaries of one chunk only."""
    n, d = y.size, means.shape[1]
    out = np.empty((n, d), dtype=np.float32)
    for start in range(0, n, _ROWS_PER_CHUNK):
        stop = min(start + _ROWS_PER_CHUNK, n)
        z = rng.standard_normal((stop - start, d))
        z *= noise  # in place, then the mean added: the values of means[y] + noise * z
        z += means[y[start:stop]]
        out[start:stop] = z
    return torch.from_numpy(out)


def _gaussian_fast(
    means: np.ndarray, y: np.ndarray, noise: float, rng: np.random.Generator
) -> torch.Tensor:
    """``means[y] + noise * N(0, I)`` as :func:`_gaussian`, drawn by torch's generator in
    float32 (seeded from ``rng``) and finished in place, chunk by chunk: no float64 draw and
    no temporaries of the whole matrix (other values, the same distribution). Used with the
    ``blocks`` sampler."""
    n, d = y.size, means.shape[1]
    g = torch.Generator().manual_seed(int(rng.integers(2**63 - 1)))
    out = torch.randn((n, d), generator=g)
    mu, labels = torch.from_numpy(means.astype(np.float32)), torch.from_numpy(y)
    if noise != 1.0:
        out.mul_(noise)
    step = _ROWS_PER_CHUNK * 4
    for start in range(0, n, step):
        out[start : start + step].add_(mu.index_select(0, labels[start : start + step]))
    return out


def _multi_hot(
    y: np.ndarray, d: int, density: float, signal: float, rng: np.random.Generator
) -> torch.Tensor:
    """A class-dependent bag of words, ``[N, d]`` sparse COO of ones: class ``c``'s words
    follow ``softmax(signal * g_c)``, ``g_c ~ N(0, I_d)``; node ``i`` draws ``round(d *
    density)`` of its class's words with replacement (a word drawn twice is one entry)."""
    n, k = y.size, max(1, round(d * density))
    logits = signal * rng.standard_normal((int(y.max()) + 1, d))
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    words = np.empty((n, k), dtype=np.int64)
    for c in range(p.shape[0]):
        members = np.flatnonzero(y == c)
        words[members] = rng.choice(d, size=(members.size, k), p=p[c])
    flat = np.sort(np.repeat(np.arange(n), k) * d + words.ravel())  # row-major
    # np.unique's values, by sorting: its hash path took 10 s for 3M entries (numpy 2.4)
    flat = flat[np.concatenate(([True], flat[1:] != flat[:-1]))] if flat.size else flat
    index = torch.from_numpy(np.stack([flat // d, flat % d]))
    return torch.sparse_coo_tensor(index, torch.ones(flat.size), (n, d), is_coalesced=True)


def make_synthetic(
    num_nodes: int = 600,
    num_classes: int = 5,
    modalities: dict[str, int] | None = None,
    p_in: float = 0.05,
    p_out: float = 0.005,
    signal: float = 1.0,
    noise: float = 1.0,
    missing_rate: float = 0.0,
    seed: int = 0,
    multi_hot: dict[str, int] | None = None,
    density: float = 0.02,
    sparse: bool = True,
    sampler: str = "auto",
) -> MultimodalGraph:
    """Generate the ``synthetic`` graph: a stochastic block model with one block per class.

    Classes are balanced and assigned by a seeded permutation; each pair of nodes is linked
    with probability ``p_in`` within a class and ``p_out`` across. Each modality ``m`` of
    dimension ``d`` (default ``{"text": 32, "image": 16}``) gives class ``c`` a mean
    ``mu_c ~ signal * N(0, I_d)`` and node ``i`` the features ``mu_{y_i} + noise * N(0, I_d)``;
    ``missing_rate`` in ``[0, 1)`` hides each modality for that fraction of the nodes
    (:func:`apply_missing`). Each ``multi_hot`` modality (name -> vocabulary size) is a bag
    of words (:func:`_multi_hot`) at about ``density`` non-zeros, sparse unless ``sparse=False``.

    ``sampler``: ``"pairs"`` decides every pair (:math:`O(N^2)`, every shipped config),
    ``"blocks"`` draws each block pair's edge count, then its endpoints
    (:func:`_sbm_edges_by_block`) and the dense modalities with torch's float32 generator
    (:func:`_gaussian_fast`: other values of the same distribution), ``"auto"`` ``"blocks"``
    above :data:`BLOCKS_ABOVE` nodes.

    Everything is a function of ``seed >= 0``; each modality's features come from a stream
    keyed by its name (adding one leaves the graph and the others unchanged). An invalid
    argument is a ValueError naming it."""
    n = _check_int("num_nodes", num_nodes, 1)
    c = _check_int("num_classes", num_classes, 1)
    if c > n:
        raise ValueError(f"make_synthetic: num_classes ({c}) must not exceed num_nodes ({n})")
    if modalities is None:
        modalities = {"text": 32, "image": 16}
    if not isinstance(modalities, Mapping) or not modalities:
        raise ValueError(
            f"make_synthetic: modalities must be a non-empty dict name -> dimension, "
            f"got {modalities!r}"
        )
    modalities, multi_hot = dict(modalities), dict(multi_hot or {})
    for key, dims in (("modalities", modalities), ("multi_hot", multi_hot)):
        for m, d in dims.items():
            if not isinstance(m, str) or not m or (key == "multi_hot" and m in modalities):
                raise ValueError(
                    f"make_synthetic: {key} keys must be non-empty strings that name no "
                    f"other modality, got {m!r}"
                )
            _check_int(f"{key}[{m!r}]", d, 1)
    density = _check_float("density", density, 0.0, 1.0)
    p_in = _check_float("p_in", p_in, 0.0, 1.0)
    p_out = _check_float("p_out", p_out, 0.0, 1.0)
    signal = _check_float("signal", signal, 0.0)
    noise = _check_float("noise", noise, 0.0)
    missing_rate = _check_float("missing_rate", missing_rate, 0.0, 1.0, high_open=True)
    if missing_rate > 0 and len(modalities) + len(multi_hot) < 2:
        # apply_missing never hides a node's last modality, so with one modality nothing
        # would be hidden; refuse rather than silently ignore the rate.
        raise ValueError(
            "make_synthetic: missing_rate > 0 needs at least two modalities, "
            f"got {list(modalities)}"
        )
    seed = _check_int("seed", seed, 0)
    if sampler not in ("auto", "pairs", "blocks"):
        raise ValueError(
            f"make_synthetic: sampler must be 'auto', 'pairs' or 'blocks', got {sampler!r}"
        )
    if sampler == "auto":
        sampler = "blocks" if n > BLOCKS_ABOVE else "pairs"

    structure = np.random.default_rng([seed, 0])
    y = structure.permutation(np.arange(n) % c)
    draw_edges = _sbm_edges_by_block if sampler == "blocks" else _sbm_edges
    edges = draw_edges(y, p_in, p_out, structure)

    features = {}
    for m, d in modalities.items():
        # crc32 rather than hash(): str hashes are salted per process.
        rng = np.random.default_rng([seed, 1, zlib.crc32(m.encode("utf-8"))])
        means = signal * rng.standard_normal((c, int(d)))
        draw = _gaussian_fast if sampler == "blocks" else _gaussian
        features[m] = draw(means, y, noise, rng)
    for m, d in multi_hot.items():
        rng = np.random.default_rng([seed, 2, zlib.crc32(m.encode("utf-8"))])
        x = _multi_hot(y, int(d), density, signal, rng)
        features[m] = x if sparse else x.to_dense()

    graph = MultimodalGraph(
        name="synthetic",
        features=features,
        mask=full_mask(n, len(features)),
        edge_index=clean_edges(torch.from_numpy(edges), n),
        y=torch.from_numpy(y.astype(np.int64)),
        class_names=[f"class_{i}" for i in range(c)],
    )
    return apply_missing(graph, missing_rate, seed, inplace=True) if missing_rate > 0 else graph
