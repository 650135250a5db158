r"""The class-incremental open-world loop for cross-modal retrieval.

Recall@1 takes the place of accuracy in the accuracy matrix (docs/metrics.md): after stage
:math:`t`, client :math:`k`'s queries are its test nodes of known classes that have both
modalities, and the candidates are the same nodes' item modality; query :math:`i` hits when
its own item ranks first (pessimistic ties, :func:`~fedlightning.metrics.recall_at_k`).
Counts are pooled over clients. A query's rejection score is its highest similarity to the
client's known-class items (the retrieval reading of FedOGL Eq. (6)); unknown-class queries
are the client's test nodes of unknown classes, scored against the same items. A method
with its own score (GRASP, CLIPN) replaces the similarity through ``query_scores``."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from fedlightning.federation.stages import SPLITS, ClassEvaluation, ContinualLoop, Parts, Pooled
from fedlightning.metrics import max_similarity, open_accuracy, recall_at_k

WRONG = -2  # a known query's label when its paired item is not ranked first


class RetrievalEvaluation(ClassEvaluation):
    """A stage's end with Recall@1 and max-similarity rejection instead of accuracy
    (``Algorithm.evaluation = "retrieval"``).

    Recall@1 fills ``train_acc``, ``val_acc`` and ``test_acc`` after every round and the
    accuracy-matrix rows after every stage, so the loop's logging, model selection and final
    metrics work unchanged. No diagnostics (Eqs. (2)-(4) need class representations)."""

    # and final-stage Recall@1 over all known-class queries, pooled over clients
    final_stage_metrics = ("recall_at_1", "val_recall_at_1")

    def check(self, algorithm: Any) -> None:
        """A retrieval method rejects by similarity (its ``score`` is ``"similarity"``)."""
        if algorithm.score not in (None, "similarity"):
            raise ValueError(f"retrieval rejects by similarity, not {algorithm.score!r}")

    # ------------------------------------------------------------------ evaluation
    @staticmethod
    def outputs(net: Any, data: Any) -> tuple[Tensor, Tensor, Tensor]:
        """``(q, k, paired-node mask)`` of the global model on one client's subgraph."""
        q, k = net(data)
        return q, k, net.pair_mask(data)

    def stage_parts(
        self,
        loop: ContinualLoop,
        c: Any,
        outputs: list[Any],
        t: int,
        splits: Iterable[str] = SPLITS,
    ) -> dict[str, Parts | None]:
        """Per split of ``splits``, client ``c``'s queries after stage ``t`` (module docstring): of the known
        ones ``[n]`` ``node_stage``, ``hit``, class ``y`` and ``known_score``, the unknown
        ones' ``unknown_score`` ``[u]``; ``None`` without a known-class pair. An algorithm
        with ``query_scores(net, q, k, data, is_known, global_state)`` (``cir_grasp``,
        ``cir_clipn``) supplies every node's score ``[N]`` in place of the similarity."""
        q, k, pairs = outputs
        data, net = c.data, loop.module.net
        node_stage = loop.class_stage[data.y]
        is_known = (node_stage >= 0) & (node_stage <= t)
        # GRASP, CLIPN: their own score
        score = loop.algorithm.query_scores(net, q, k, data, is_known, loop.server.global_state)
        out: dict[str, Parts | None] = {}
        for s in splits:
            m = data[f"{s}_mask"]
            known = m & is_known & pairs
            if not known.any():
                out[s] = None
                continue
            unknown = m & ~is_known & net.availability(data, net.query)
            items = k[known]
            out[s] = {
                "node_stage": node_stage[known],
                "hit": recall_at_k(q[known], items, 1),
                "y": data.y[known],
                "known_score": max_similarity(q[known], items) if score is None else score[known],
                "unknown_score": (
                    score[unknown]
                    if score is not None
                    else max_similarity(q[unknown], items)
                    if unknown.any()
                    else q[:0, 0]
                ),
            }
        return out

    def open_metrics(
        self, loop: ContinualLoop, t: int, cat: Pooled, delta: float, forward: list[tuple]
    ) -> dict[str, float]:
        """Recall@1 over all known-class queries, pooled over clients, and the open-set
        accuracy: known queries are right when accepted and hit, unknown ones when rejected."""
        hit, y = cat("test", "hit").bool(), cat("test", "y").long()
        known_score, unknown_score = cat("test", "known_score"), cat("test", "unknown_score")
        wrong = torch.full((unknown_score.numel(),), WRONG, dtype=torch.long)
        pred = torch.cat([torch.where(hit, y, WRONG), wrong])
        pred = torch.where(torch.cat([known_score, unknown_score]) >= delta, pred, -1)
        is_known = torch.arange(pred.numel()) < y.numel()
        return {
            "recall_at_1": _mean(hit),
            "val_recall_at_1": _mean(cat("val", "hit")),
            "open_acc": open_accuracy(pred, torch.cat([y, wrong]), is_known),
        }


def split_scores(
    fn: Callable[[Tensor, Tensor], Tensor], q: Tensor, k: Tensor, items: Tensor, data: Any
) -> Tensor:
    """Every node's score ``[N]`` against the items of its own split, as the loop scores
    queries: ``fn(q[rows], k[items & split])`` for the rows of each of the ``train``, ``val``
    and ``test`` masks (``items``: bool ``[N]``, the known-class paired nodes); ``0`` for a
    node in no split or in a split without items."""
    out = torch.zeros(q.size(0), dtype=q.dtype, device=q.device)
    for s in ("train", *SPLITS):
        rows, pool = data[f"{s}_mask"], items & data[f"{s}_mask"]
        if rows.any() and pool.any():
            out[rows] = fn(q[rows], k[pool])
    return out


def _mean(x: Tensor) -> float:
    return float(x.double().mean()) if x.numel() else math.nan
