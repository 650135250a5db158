"""The class-incremental open-world loop: stages of rounds, stage-end open-world evaluation."""

from __future__ import annotations

import copy
import csv
import logging
import math
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fedlightning.clients.minibatch import node_outputs
from fedlightning.data.streams import ClassStream
from fedlightning.federation.loop import FederatedLoop, sample_clients
from fedlightning.federation.round import ClientWork, federated_round
from fedlightning.federation.stacking import outputs_in_one_pass
from fedlightning.messages import ServerBroadcast
from fedlightning.metrics import (
    AccuracyMatrix,
    auroc_known_vs_unknown,
    average_accuracy,
    basis_drift,
    class_centroids,
    discrepancy_spread,
    dispersion_of,
    energy_score,
    forgetting,
    forgetting_diag,
    fpr_at_tpr,
    msp_score,
    open_accuracy,
    principal_basis,
    prototype_discrepancies,
    seen_accuracy_curve,
    semantic_drift,
    threshold_at_tpr,
)
from fedlightning.metrics.open_set import score_sign
from fedlightning.server.aggregate import model_state

log = logging.getLogger(__name__)


def _row(matrix: AccuracyMatrix, T: int, t: int) -> list[float]:
    """Row ``t`` of an accuracy matrix; ``reshape`` because torchmetrics squeezes the
    ``[1, 1]`` matrix of a one-stage stream to a scalar."""
    return matrix.compute().reshape(T, T)[t].tolist()


SCORE_FNS = {"msp": msp_score, "energy": energy_score}
SPLITS = ("val", "test")
Parts = dict[str, Tensor]  # one client's part of a split's stage-end evaluation
Pooled = Callable[[str, str], Tensor]  # (split, field) -> the field pooled over clients


class ClassEvaluation:
    """What a stage's end measures on a classifier: the closed-set accuracy over the known
    classes, the rejection scores of the logits (or the method's own ``node_score``), the
    open-set accuracy and the diagnostics of FedOGL Eqs. (2)-(4). The retrieval loop's
    counterpart is :class:`~fedlightning.federation.retrieval_stages.RetrievalEvaluation`;
    a method names its own by ``Algorithm.evaluation``."""

    final_stage_metrics: tuple[str, ...] = ()  # the last stage's, beside the loop's own

    def check(self, algorithm: Any) -> None:
        """Refuse a method this evaluation cannot score (none here)."""

    @staticmethod
    def outputs(net: Any, data: Any) -> tuple[Tensor, dict[str, Tensor]]:
        """``(logits, representations)`` of the global model on one client's subgraph."""
        reps = net.representations(data) if hasattr(net, "representations") else {}
        return (net.head(reps["z"]) if "z" in reps else net(data)), reps

    def stage_parts(
        self,
        loop: ContinualLoop,
        c: Any,
        outputs: list[Any],
        t: int,
        splits: Iterable[str] = SPLITS,
    ) -> dict[str, Parts | None]:
        """Per split of ``splits``, client ``c``'s nodes after stage ``t``: of the known-class nodes the
        stage that introduced their class ``node_stage`` and the closed-set ``hit`` (the
        argmax over the known classes is right); the rejection scores ``known_score`` and
        ``unknown_score``; every node's ``node, client, y, pred, score, known``."""
        logits, _ = outputs
        known = torch.tensor(loop.stream.known(t), dtype=torch.long)
        y = c.data.y
        node_stage = loop.class_stage[y]
        is_known = (node_stage >= 0) & (node_stage <= t)
        pred = known[logits[:, known].argmax(-1)]
        score = loop.node_score(c, outputs, t)
        out = {}
        for s in splits:
            m = c.data[f"{s}_mask"]
            mk = m & is_known  # the matrix is closed-set over the known classes
            node = c.data.node_id[m] if "node_id" in c.data else m.nonzero().squeeze(1)
            out[s] = {
                "node_stage": node_stage[mk],
                "hit": (pred == y)[mk],
                "known_score": score[mk],
                "unknown_score": score[m & ~is_known],
                "node": node,
                "client": torch.full_like(node, c.client_id),
                "y": y[m],
                "pred": pred[m],
                "score": score[m],
                "known": is_known[m],
            }
        return out

    def open_metrics(
        self, loop: ContinualLoop, t: int, cat: Pooled, delta: float, forward: list[tuple]
    ) -> dict[str, float]:
        """The open-set accuracy of the test nodes (those scored below ``delta`` rejected as
        unknown; every one's score kept for ``test_scores.pt``) and :meth:`diagnostics`."""
        fields = ("node", "client", "y", "pred", "score", "known")
        per_node = {k: cat("test", k) for k in fields}
        loop.test_scores.append({**per_node, "threshold": delta})
        pred = per_node["pred"]
        pred_open = torch.where(per_node["score"] >= delta, pred, torch.full_like(pred, -1))
        return {
            "open_acc": open_accuracy(pred_open, per_node["y"], per_node["known"]),
            **loop.diagnostics(t, [(c, reps) for c, _, reps in forward]),
        }


class ContinualLoop(FederatedLoop):
    """Runs ``T`` stages of ``rounds_per_stage`` rounds in the class-incremental stream:
    closed-set accuracy over the known classes after every round, the open-world evaluation
    of docs/architecture.md (Eq. (6)'s threshold, FedOGL Eqs. (2)-(4)) after every stage.

    Args:
        stream: the materialized class stream.
        rounds_per_stage: rounds in every stage (``federation.rounds``).
        num_classes: classes of the graph.
        basis_rank: ``r`` of the structural-basis probe (Eq. (3)); default ``8``.
        on_stage_end: ``(stage, metrics) -> None`` (1-based stage), e.g. MLflow logging.
        evaluation: what a stage's end measures (default :class:`ClassEvaluation`).
        **kw: as :class:`FederatedLoop`; ``rounds`` is set to ``T x rounds_per_stage``."""

    # the last stage's metrics that the run's final metrics repeat
    final_stage_metrics: tuple[str, ...] = (
        "fpr95",
        "auroc_ood",
        "open_acc",
        "val_fpr95",
        "val_auroc_ood",
        "d_sem",
        "d_str",
        "d_fed",
        "d_fed_local",
        "d_fed_local_std",
        "d_fed_local_class_std",
        "d_fed_local_client_std",
    )

    def __init__(
        self,
        *args: Any,
        stream: ClassStream,
        rounds_per_stage: int,
        num_classes: int,
        basis_rank: int = 8,
        on_stage_end: Callable[[int, dict[str, float]], None] | None = None,
        evaluation: Any = None,
        **kw: Any,
    ) -> None:
        kw["rounds"] = stream.num_stages * rounds_per_stage
        super().__init__(*args, **kw)
        self.evaluation = evaluation or ClassEvaluation()
        self.evaluation.check(self.algorithm)
        self.stream, self.rounds_per_stage = stream, rounds_per_stage
        self.num_classes, self.basis_rank = num_classes, basis_rank
        self.on_stage_end = on_stage_end
        self.class_stage = stream.class_stage(num_classes)
        self.rows: dict[str, list[list[float]]] = {"test": [], "val": []}
        self.client_rows: dict[int, list[list[float]]] = {c.client_id: [] for c in self.clients}
        self.stage_results: list[dict[str, float]] = []
        self.test_scores: list[dict[str, Any]] = []  # per stage: every test node's score
        self.centroids_at_intro: dict[int, Tensor] = {}
        self.bases_at_end: dict[int, Tensor] = {}
        self.prototype_terms: list[list[list]] = []  # per stage: [class, client, Eq. (4) term]

    def stage_of(self, round: int) -> int:
        return (round - 1) // self.rounds_per_stage

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def _forward_all(self) -> list[tuple]:
        """Global model on every client's whole subgraph: ``(client, *outputs)``; with
        ``algorithm.personalized``, each client's own model (:meth:`_forward_own`)."""
        if self.algorithm.personalized:
            return self._forward_own()
        if self.stacking():  # one pass over every client (docs/scaling.md)
            graphs, state = [c.data for c in self.clients], self.server.global_state
            outs = outputs_in_one_pass(self.module.net, state, graphs, self.evaluation.outputs)
            return [(c, *o) for c, o in zip(self.clients, outs, strict=True)]
        self.module.receive(self.server.global_state)
        net = self.module.net
        net.eval()
        mb = getattr(self.module, "minibatch", None)  # batched beyond its budget
        outputs = partial(self.evaluation.outputs, net)
        out = [(c, *node_outputs(outputs, c.data, mb)) for c in self.clients]
        net.train()
        return out

    def _forward_own(self) -> list[tuple]:
        """Client ``c`` evaluated, one at a time, with the weights it would load from the
        server's broadcast, ``algorithm.eval_state(c, broadcast)`` (FedIIH's personalized
        blocks)."""
        broadcast = self.server.broadcast(self.completed_rounds + 1)
        net = self.module.net
        out = []
        for c in self.clients:
            net.load_state_dict(self.algorithm.eval_state(c, broadcast))
            net.eval()
            out.append((c, *self.evaluation.outputs(net, c.data)))
        net.train()
        return out

    def evaluate(self, round: int) -> dict[str, float]:
        """Closed-set accuracy over the known classes of the current stage (the ``hit`` of
        the evaluation's ``stage_parts``), per split, pooled over clients."""
        totals = {s: [0, 0] for s in ("train", *SPLITS)}
        for c, *outputs in self._forward_all():
            for s, r in self.evaluation.stage_parts(
                self, c, outputs, self.stage_of(round), totals
            ).items():
                if r is not None:
                    totals[s][0] += int(r["hit"].sum())
                    totals[s][1] += r["hit"].numel()
        return {f"{s}_acc": a / n if n else math.nan for s, (a, n) in totals.items()}

    def end_of_round(self, round: int) -> None:
        if round % self.rounds_per_stage:
            return
        t = self.stage_of(round)
        res = self.evaluate_stage(t)
        self.stage_results.append(res)
        log.info(
            "stage %d/%d  seen_acc %.4f  fpr95 %.4f  auroc %.4f  open_acc %.4f",
            t + 1,
            self.stream.num_stages,
            res["seen_acc"],
            res["fpr95"],
            res["auroc_ood"],
            res["open_acc"],
        )
        self.stage_end_exchange(t, round)

    def report(self, round: int, metrics: dict[str, float]) -> None:
        """The round's metrics, then (at a stage's end) the stage's to ``on_stage_end``."""
        super().report(round, metrics)
        if round % self.rounds_per_stage == 0 and self.on_stage_end:
            self.on_stage_end(self.stage_of(round) + 1, self.stage_results[-1])

    def stage_end_exchange(self, t: int, round: int) -> None:
        """A method's stage-end messages (FedOGL's residual bases, Eq. (7)): a round of its
        own kind, all counted. The stage's final global model goes to every client sampled
        in one of the stage's rounds (the server knows them without reading client state);
        each answers with ``algorithm.stage_end_update`` (or nothing), and the server's
        modules take the answers in (``server.end_stage``)."""
        if not self.algorithm.stage_end_exchange:
            return
        rounds = range(t * self.rounds_per_stage + 1, (t + 1) * self.rounds_per_stage + 1)
        k = len(self.clients)
        took_part = {c for r in rounds for c in sample_clients(self.seed, r, k, self.participation)}

        def work(broadcast: ServerBroadcast) -> ClientWork:
            return ClientWork(
                one=lambda c: self.algorithm.stage_end_update(self.module, c, broadcast, t),
                kind="stage_end",
                params={"stage": t},
                uplink=self.algorithm.stage_end_uplink(broadcast),
            )

        t0 = time.perf_counter()
        sent = federated_round(
            round,
            self.server,
            self.runner,
            [self.clients[c] for c in sorted(took_part)],
            work,
            self.ledger,
            aggregate=lambda _, updates: self.server.end_stage(t, updates),
            desc=f"stage {t + 1} end",
            min_clients=self.min_clients,
        )
        log.info(
            "stage %d end exchange: %d clients, %d answers, %.3f MiB up  (%.1fs)",
            t + 1,
            len(took_part),
            len(sent),
            4 * sum(u.num_values() for u in sent) / 1024**2,
            time.perf_counter() - t0,
        )

    def evaluate_stage(self, t: int) -> dict[str, float]:
        """The open-world evaluation after stage ``t`` (0-based): every client's
        the evaluation's ``stage_parts`` give the accuracy-matrix rows (pooled, and per client on test)
        and the known- and unknown-class rejection scores, pooled over clients."""
        T = self.stream.num_stages
        mats = {s: AccuracyMatrix(T) for s in SPLITS}
        parts: dict[str, list[dict[str, Tensor]]] = {s: [] for s in SPLITS}
        forward = self._forward_all()
        for c, *outputs in forward:
            client_mat = AccuracyMatrix(T)
            for s, r in self.evaluation.stage_parts(self, c, outputs, t).items():
                if r is not None:
                    mats[s].update(t, r["node_stage"], r["hit"])
                    if s == "test":
                        client_mat.update(t, r["node_stage"], r["hit"])
                    parts[s].append(r)
            self.client_rows[c.client_id].append(_row(client_mat, T, t))
        for s in SPLITS:
            self.rows[s].append(_row(mats[s], T, t))
        sign = self.orient(parts)

        def cat(split: str, field: str) -> Tensor:
            got = [r[field] for r in parts[split]]
            return torch.cat(got) if got else torch.zeros(0)

        delta = threshold_at_tpr(cat("val", "known_score"))  # Eq. (6)'s delta_t: val only
        test = cat("test", "known_score"), cat("test", "unknown_score")
        val = cat("val", "known_score"), cat("val", "unknown_score")
        return {
            "stage": t + 1,
            "seen_acc": seen_accuracy_curve(self.matrix("test"))[t],
            "val_seen_acc": seen_accuracy_curve(self.matrix("val"))[t],
            "threshold": delta,
            "fpr95": fpr_at_tpr(*test),
            "auroc_ood": auroc_known_vs_unknown(*test),
            "val_fpr95": fpr_at_tpr(*val),
            "val_auroc_ood": auroc_known_vs_unknown(*val),
            **self.evaluation.open_metrics(self, t, cat, delta, forward),
            **({"score_sign": sign} if self.algorithm.calibrate_direction else {}),
        }

    def node_score(self, c: Any, outputs: list[Any], t: int) -> Tensor:
        """Every node's rejection score on client ``c`` after stage ``t``: the algorithm's
        own ``node_score(logits, known_mask, data, reps, global_state)`` where it has one
        (TopoOOD, GRASP, CLIPN), else its ``score`` of the logits (MSP, energy)."""
        logits, reps = outputs
        known = self.stream.known_mask(t, self.num_classes)
        own = self.algorithm.node_score(logits, known, c.data, reps, self.server.global_state)
        return own if own is not None else SCORE_FNS[self.algorithm.score](logits, known)

    def orient(self, parts: dict[str, list[Parts]]) -> float:
        """With ``algorithm.calibrate_direction``: the sign that makes the score a
        known-class score on validation (:func:`score_sign`), applied to every score field
        of ``parts`` in place; ``1.0`` otherwise (the scores untouched)."""
        if not self.algorithm.calibrate_direction:
            return 1.0
        val = [torch.cat([r[f] for r in parts["val"]]) for f in ("known_score", "unknown_score")]
        sign = score_sign(*val) if parts["val"] else 1.0
        if sign < 0:
            for split in parts.values():
                for r in split:
                    for f in ("known_score", "unknown_score", "score"):
                        if f in r:
                            r[f] = -r[f]
        return sign

    def diagnostics(
        self, t: int, reps_all: list[tuple[Any, dict[str, Tensor]]]
    ) -> dict[str, float]:
        """FedOGL Eqs. (2)-(4) from a probe on the global model's representations.

        Semantic drift of old-class centroids of ``s`` since their stage (Eq. (2)), drift of
        the top-``r`` basis of ``g`` on each earlier stage's training nodes since that
        stage's end (Eq. (3), averaged over earlier stages), and the dispersion of the
        clients' class prototypes of ``z`` around their count-weighted mean (Eq. (4)), with
        the spread of its client-by-class terms (kept in ``prototype_terms``, Fig. 3)."""
        if not reps_all or not reps_all[0][1]:
            return {}
        known = self.stream.known(t)
        train = [(c.data.train_mask, c.data.y, r) for c, r in reps_all]
        s_cat = torch.cat([r["s"][m] for m, _, r in train])
        y_cat = torch.cat([y[m] for m, y, _ in train])
        now = class_centroids(s_cat, y_cat, known)
        for cl in self.stream.stages[t]:
            self.centroids_at_intro.setdefault(cl, now[cl])
        old = [cl for s in self.stream.stages[:t] for cl in s]
        d_sem = (
            semantic_drift({c: self.centroids_at_intro[c] for c in old}, {c: now[c] for c in old})
            if old
            else 0.0
        )
        g_cat = torch.cat([r["g"][m] for m, _, r in train])
        drifts = []
        for i in range(t + 1):
            g = g_cat[torch.isin(y_cat, torch.tensor(self.stream.stages[i]))]
            if min(g.shape) <= self.basis_rank:
                continue
            basis = principal_basis(g, self.basis_rank)
            if i == t:
                self.bases_at_end[i] = basis
            elif i in self.bases_at_end:
                drifts.append(basis_drift(self.bases_at_end[i], basis))
        glob_terms = self.prototype_terms_of(known, reps_all)
        out = {
            "d_sem": d_sem,
            "d_str": sum(drifts) / len(drifts) if drifts else 0.0,
            "d_fed": dispersion_of(glob_terms),
        }
        # the clients of the round just run (the stage's last); under secure aggregation the
        # server sees masked shares only, no client's model
        if self.last_updates and getattr(self.server, "secure", None) is None:
            terms = self.prototype_terms_of(known, self.uplinked_representations())
            self.prototype_terms.append(
                [[cl, k, v] for cl, by_client in terms.items() for k, v in by_client.items()]
            )
            out["d_fed_local"] = dispersion_of(terms)
            out.update(discrepancy_spread(terms, "d_fed_local"))
        return out

    @staticmethod
    def prototype_terms_of(
        known: list[int], reps_all: list[tuple[Any, dict[str, Tensor]]]
    ) -> dict[int, dict[int, float]]:
        """The terms of Eq. (4), ``{class: {client: 1 - cos}}``: each client's prototype of
        a known class (the mean ``z`` of its training nodes of it) against their mean
        weighted by the clients' node counts (FedAvg's weights)."""
        local: dict[int, dict[int, Tensor]] = {}
        weights: dict[int, list[int]] = {}
        for c, r in reps_all:
            m, y = c.data.train_mask, c.data.y
            for cl in known:
                sel = m & (y == cl)
                if sel.any():
                    local.setdefault(cl, {})[c.client_id] = r["z"][sel].mean(0)
                    weights.setdefault(cl, []).append(int(sel.sum()))
        glob = {
            cl: sum(w * p for w, p in zip(weights[cl], ps.values(), strict=True)) / sum(weights[cl])
            for cl, ps in local.items()
        }
        return prototype_discrepancies(local, glob)

    @torch.no_grad()
    def uplinked_representations(self) -> list[tuple[Any, dict[str, Tensor]]]:
        """Each client of the round just run with the representations of the model it
        uplinked (its local model after the fit; fields it did not send: the global
        model's) on its own subgraph: Fig. 3's local prototypes come from these."""
        net = copy.deepcopy(self.module.net).eval()
        base, glob = net.state_dict(), self.server.global_state
        by_id = {c.client_id: c for c in self.clients}
        out = []
        for u in self.last_updates:
            sent = model_state(u.tensors)
            net.load_state_dict({k: sent.get(k, glob.get(k, v)) for k, v in base.items()})
            data, mb = by_id[u.client_id].data, getattr(self.module, "minibatch", None)
            out.append((by_id[u.client_id], node_outputs(net.representations, data, mb)))
        return out

    # ------------------------------------------------------------------ results
    def matrix(self, split: str = "test") -> Tensor:
        """The accuracy matrix ``M[t, j]`` so far (NaN above the diagonal)."""
        T = self.stream.num_stages
        m = torch.full((T, T), math.nan, dtype=torch.float64)
        for t, row in enumerate(self.rows[split]):
            m[t] = torch.tensor(row, dtype=torch.float64)
        return m

    def final_metrics(self) -> dict[str, float]:
        out = super().final_metrics()
        for k in ("best_val_acc", "best_val_round", "test_acc_at_best_val"):
            out.pop(k)  # each stage has its own known classes: not comparable across rounds
        for prefix, split in (("", "test"), ("val_", "val")):
            m = self.matrix(split)
            out[f"{prefix}am"] = average_accuracy(m)
            out[f"{prefix}fm"] = forgetting(m)
            out[f"{prefix}fm_diag"] = forgetting_diag(m)
        last = self.stage_results[-1]
        names = (*self.final_stage_metrics, *self.evaluation.final_stage_metrics)
        out.update({k: last[k] for k in names if k in last})
        return out

    def summary_extras(self) -> dict[str, Any]:
        """NaN (a stage not yet seen) becomes null in summary.json (``Run.finish``)."""
        return {
            "acc_matrix": self.matrix("test").tolist(),
            "val_acc_matrix": self.matrix("val").tolist(),
            "client_acc_matrices": {str(k): v for k, v in self.client_rows.items()},
            "stages": self.stage_results,
            "stream": {"stages": self.stream.stages, "never": self.stream.never},
            "prototype_terms": self.prototype_terms,
        }

    def write_artifacts(self, run_dir: Path, title: str, plots: bool = True) -> list[Path]:
        paths = super().write_artifacts(run_dir, title, plots)
        m = self.matrix("test")
        csv_path = run_dir / "acc_matrix.csv"
        with csv_path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["after_stage", *[f"stage_{j + 1}" for j in range(m.size(1))]])
            for t, row in enumerate(m.tolist()):
                w.writerow([t + 1, *["" if math.isnan(v) else f"{v:.6f}" for v in row]])
        paths.append(csv_path)
        if plots:
            from fedlightning.tracking.plots import plot_accuracy_matrix, plot_seen_accuracy

            paths.append(plot_accuracy_matrix(m, run_dir / "acc_matrix.png", title=title))
            seen = run_dir / "seen_acc.png"
            paths.append(plot_seen_accuracy(self.stage_results, seen, title=title))
        if self.prototype_terms:
            paths += self.write_prototype_terms(run_dir, title, plots)
        if self.test_scores:
            torch.save(self.test_scores, run_dir / "test_scores.pt")
            paths.append(run_dir / "test_scores.pt")
        return paths

    def write_prototype_terms(self, run_dir: Path, title: str, plots: bool = True) -> list[Path]:
        """Every stage's client-by-class terms of Eq. (4) (``d_fed_terms.csv``) and, unless
        ``plots`` is false, the last stage's as a heatmap (``d_fed_terms.png``, the paper's
        Fig. 3)."""
        csv_path = run_dir / "d_fed_terms.csv"
        with csv_path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["after_stage", "class", "client", "discrepancy"])
            for t, rows in enumerate(self.prototype_terms):
                w.writerows([t + 1, cl, k, f"{v:.6f}"] for cl, k, v in rows)
        if not plots:
            return [csv_path]
        from fedlightning.tracking.plots import plot_client_class_matrix

        png = plot_client_class_matrix(
            {f"after stage {len(self.prototype_terms)}": self.prototype_terms[-1]},
            run_dir / "d_fed_terms.png",
            title=f"{title}: 1 - cos(client prototype, global prototype)",
        )
        return [csv_path, png]

    # ------------------------------------------------------------------ state
    own_state = ("rows", "client_rows", "stage_results", "centroids_at_intro", "bases_at_end")

    def state_dict(self) -> dict[str, Any]:
        extra = {k: getattr(self, k) for k in (*self.own_state, "test_scores", "prototype_terms")}
        return {**super().state_dict(), "extra": extra}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for k in self.own_state:
            setattr(self, k, state["extra"][k])
        self.test_scores = state["extra"].get("test_scores", [])  # not in older checkpoints
        self.prototype_terms = state["extra"].get("prototype_terms", [])  # nor these
