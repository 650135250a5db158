"""FedTIP's whole task protocol: the platform against plain-torch references, side by side.

Three implementations of the same math over the same cached contexts (paper 001, Eqs. 13-31):

- ``platform``: :class:`fedlightning.federation.task_loop.TaskLoop` (the LightningModule's
  hooks through the lean executor, typed messages, the ledger, the server module), with
  the active clients of a round stacked into one fit;
- ``torch, per client``: a hand-written loop, one adapter copy and one Adam per client
  and round, the server arithmetic inline;
- ``torch, stacked``: the same hand-written loop training the round's clients together as
  the platform does (the floor for the platform's overhead).

Each prints its wall time (evaluation included) and mean AUCs; the ratios are to the
platform's time. Run on an idle machine, e.g.

    python benchmarks/fedtip_protocol.py --experiment fedtip_bitcoin_alpha --tasks 100
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

from fedlightning.clients.temporal_prompt import score_segment as evaluate
from fedlightning.clients.temporal_prompt import stack_batches
from fedlightning.config import build
from fedlightning.federation.executors import LeanExecutor
from fedlightning.federation.runners import SequentialRunner
from fedlightning.federation.task_loop import TaskLoop
from fedlightning.programs.temporal_program import check_families, temporal_inputs
from fedlightning.resources import conf_dir
from fedlightning.temporal.adapter import PromptAdapter
from fedlightning.utils.seeding import derive_seed

CONF = str(conf_dir())
INPUTS = ("h_u", "h_i", "te", "x", "r_u", "r_i")


def setup(experiment: str, tasks: int):
    """The experiment's algorithm, first ``tasks`` tasks, server segments, dims and families,
    read as a run reads them (protocol, bank and contexts built or reused from the cache)."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(
            "train", overrides=[f"experiment={experiment}", "logger=none", f"max_tasks={tasks}"]
        )
    inputs = temporal_inputs(cfg)
    families = check_families(cfg.families, inputs["protocol"].stream)
    algorithm = build(cfg.algorithm, "algorithm")
    return cfg, algorithm, inputs["tasks"], inputs["evals"], inputs["dims"], families


# ---------------------------------------------------------------- the plain-torch reference
def ref_views(a: PromptAdapter, b: dict, family: str, k: int | None = None):
    """2-D (one client, ``k=None``) or stacked views, written out."""

    def prompt(side):
        args = [b["h_u"], b[f"h_{side}"], b["te"], b["x"], b["r_u"], b[f"r_{side}"]]
        return a(*args)

    if family == "nc":
        return prompt("i"), b["y"], b["mask"]
    return prompt("i"), b["h_i"], prompt("j"), b["h_j"], b["mask"] & b["neg_ok"]


def ref_prototypes(views, family):
    if family == "nc":
        h, y, m = views
        ys = y.masked_fill(~m, -1)
    else:
        hp, _, hn, _, m = views
        h = torch.cat([hn, hp], -2)
        ys = torch.cat(
            [torch.zeros_like(m, dtype=torch.long), torch.ones_like(m, dtype=torch.long)], -1
        )
        ys = ys.masked_fill(~torch.cat([m, m], -1), -1)
    onehot = torch.stack([(ys == c).float() for c in (0, 1)], -1)
    counts = onehot.sum(-2)
    return (onehot.transpose(-1, -2) @ h) / counts.clamp(min=1).unsqueeze(-1), counts


def ref_loss(a, b, family, alg, start, anchors):
    views = ref_views(a, b, family)
    q, counts = ref_prototypes(views, family)
    if family == "nc":
        h, y, m = views
        logits = F.cosine_similarity(h.unsqueeze(-2), q.unsqueeze(-3), dim=-1) / alg.tau
        logits = logits.masked_fill((counts == 0).unsqueeze(-2), float("-inf"))
        nll = -logits.log_softmax(-1).gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    else:
        hp, hi, hn, hj, m = views
        pos = F.cosine_similarity(hp, hi, dim=-1) / alg.tau
        nll = torch.logaddexp(pos, F.cosine_similarity(hn, hj, dim=-1) / alg.tau) - pos
    loss = torch.where(m, nll, torch.zeros_like(nll)).sum()
    loss = loss + alg.lambda_p * sum(((p - start[n]) ** 2).sum() for n, p in a.named_parameters())
    if anchors:
        rho = counts / counts.sum(-1, keepdim=True)
        for c, anchor in anchors.items():
            cos = F.cosine_similarity(q[..., c, :], anchor, dim=-1)
            loss = loss + alg.lambda_a * (rho[..., c] * (1 - cos) * (counts[..., c] > 0)).sum()
    return loss


def ref_round_server(omega, deltas, counts, anchors, protos, alg):
    """Eqs. (27)-(31), (23)-(24) written out."""
    norms = torch.stack([d.norm() for d in deltas]).double()
    gamma = norms.quantile(0.5)
    n = torch.stack([c.sum() for c in counts]).double()
    cover = torch.stack([1 - 0.5 * (c / c.sum() - 0.5).abs().sum() for c in counts]).double()
    r = cover * torch.clamp(gamma / (norms + 1e-8), max=1.0)
    w = n * r / (n * r).sum()
    omega = (
        omega + alg.eta_s * sum(wk * d.double() for wk, d in zip(w, deltas, strict=True)).float()
    )
    new = dict(anchors)
    for c in (0, 1):
        a = torch.stack([r[k] * counts[k][c] for k in range(len(deltas))]).double()
        if a.sum() <= 0:
            continue
        q_hat = sum(a[k] * protos[k][c].double() for k in range(len(deltas))) / (a.sum() + 1e-8)
        mixed = (
            q_hat if c not in anchors else (1 - alg.beta) * anchors[c].double() + alg.beta * q_hat
        )
        new[c] = F.normalize(mixed, dim=0).float()
    return omega, new


def reference(alg, tasks, evals, families, dims, rounds, epochs, seed, stacked: bool):
    results = []
    for task in tasks:
        row = {}
        for family in families:
            torch.manual_seed(derive_seed(seed, "init", task.task, family))
            glob = alg.adapter(*dims)
            flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])  # noqa: E731
            omega, anchors, ids = flat(glob), {}, list(task.clients)
            batches = [task.clients[k] for k in ids]
            for _ in range(rounds):
                torch.nn.utils.vector_to_parameters(omega, glob.parameters())
                start = {n: p.detach().clone() for n, p in glob.named_parameters()}
                if stacked:
                    local = glob.stacked(len(ids))
                    b = stack_batches(batches)
                    fits = [(local, b)]
                else:
                    fits = []
                    for b in batches:
                        local = alg.adapter(*dims)
                        local.load_state_dict(glob.state_dict())
                        one = {k: v.unsqueeze(0) for k, v in b.items()}
                        one["mask"] = torch.ones(1, len(b["h_u"]), dtype=torch.bool)
                        fits.append((local, one))
                deltas, counts, protos = [], [], []
                for local, b in fits:
                    opt = torch.optim.Adam(
                        local.parameters(), lr=alg.lr, weight_decay=alg.weight_decay, foreach=True
                    )
                    local.train()
                    for _ in range(epochs):
                        loss = ref_loss(local, b, family, alg, start, anchors)
                        opt.zero_grad()
                        loss.backward()
                        opt.step()
                    local.eval()
                    with torch.no_grad():
                        q, c = ref_prototypes(ref_views(local, b, family), family)
                        d = torch.cat(
                            [(p - start[n]).flatten(1) for n, p in local.named_parameters()], 1
                        )
                    deltas += list(d)
                    counts += list(c)
                    protos += list(q)
                omega, anchors = ref_round_server(omega, deltas, counts, anchors, protos, alg)
            torch.nn.utils.vector_to_parameters(omega, glob.parameters())
            for split, b in evals.items():
                for key, v in evaluate(glob, anchors, b, family).items():
                    row[("val_" if split == "val" else "") + key] = v
        results.append(row)
    return results


def means(results):
    keys = [k for k in results[0] if k.startswith("auc")]
    return {k: statistics.fmean(v for r in results if (v := r[k]) == v) for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", default="fedtip_bitcoin_alpha")
    ap.add_argument("--tasks", type=int, default=100)
    ap.add_argument("--skip-per-client", action="store_true", help="skip the slowest reference")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg, alg, tasks, evals, dims, families = setup(args.experiment, args.tasks)
    rounds, epochs, seed = (
        int(cfg.federation.rounds),
        int(cfg.federation.local_epochs),
        int(cfg.seed),
    )
    fits = sum(len(t.clients) for t in tasks) * rounds * len(families)
    print(
        f"{args.experiment}: {len(tasks)} tasks x {families} x {rounds} rounds x {epochs} epochs = {fits} client fits"
    )
    rows = []
    runner = SequentialRunner(LeanExecutor(), progress=False)
    t0 = time.perf_counter()
    loop = TaskLoop(
        alg,
        tasks,
        evals,
        families,
        dims,
        runner,
        rounds=rounds,
        epochs=epochs,
        seed=seed,
        progress=False,
    )
    loop.run()
    rows.append(("platform (stacked clients)", time.perf_counter() - t0, loop.final_metrics()))
    for name, stacked in (("torch, stacked", True), ("torch, per client", False)):
        if not stacked and args.skip_per_client:
            continue
        t0 = time.perf_counter()
        res = reference(alg, tasks, evals, families, dims, rounds, epochs, seed, stacked)
        rows.append((name, time.perf_counter() - t0, means(res)))
    base = rows[0][1]
    print(f"{'implementation':<28} {'wall s':>8} {'x platform':>10}  mean AUCs")
    for name, wall, m in rows:
        aucs = "  ".join(
            f"{k} {v:.3f}"
            for k, v in sorted(m.items())
            if k.startswith("auc") and not k.endswith("std")
        )
        print(f"{name:<28} {wall:8.1f} {wall / base:10.2f}  {aucs}")


if __name__ == "__main__":
    main()
