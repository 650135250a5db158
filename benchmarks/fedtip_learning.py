"""Does FedTIP's adapter learn? FedTIP (both readings of Eq. 16) against the zero-shot row.

For each stream, the first ``--tasks`` tasks of the manifest are run with the zero-shot row
(``algorithm=zero_shot``: the frozen bank's template, Eq. 10) and FedTIP at the paper's
defaults with ``algorithm.template=residual`` and ``=paper`` (paper 001, Eqs. 13-17), on the
same cached bank, contexts, negatives and server segments, one process; the paper-budget
setting (``algorithm=fedtip_budget``) and both templates at ten times Adam's step size
(``algorithm.lr=0.01``) as extra rows. Besides the AUCs
(mean over tasks and a two-standard-error margin; the per-task difference to the zero-shot
row with its own margin), it records from inside the task loop:

- the distance of the server's adapter from its initial state after every round,
  :math:`\\lVert\\Omega^{(r)} - \\Omega^{(0)}\\rVert_2` (absolute, and relative to
  :math:`\\lVert\\Omega^{(0)}\\rVert_2`);
- the gates of Eqs. (14)-(15) on the server's test segment, initial and final: their mean,
  and their spread over events (the standard deviation over events of an event's mean gate);
- for link prediction, the share of the score that comes from the bank's template: with
  :math:`\\tilde{\\mathbf{h}} = T + L`, :math:`T = \\alpha^f_u \\odot \\mathbf{h}_u` (the
  residual) and :math:`L = \\psi(\\cdot)`, the cosine's numerator splits as
  :math:`T \\cdot \\hat{\\mathbf{h}}_i + L \\cdot \\hat{\\mathbf{h}}_i`; the share is the mean
  over test events of :math:`|T \\cdot \\hat{\\mathbf{h}}_i| / (|T \\cdot \\hat{\\mathbf{h}}_i|
  + |L \\cdot \\hat{\\mathbf{h}}_i|)` (0 for the paper's template, which has no :math:`T`), and
  the Pearson correlation of FedTIP's score with the bank's :math:`s(\\mathbf{h}_u,
  \\mathbf{h}_v)` over the test positives and negatives.

Prints a table and writes the numbers to ``--out`` (JSON):

    python benchmarks/fedtip_learning.py --streams bitcoin_alpha wikipedia --tasks 20
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from fedtip_tuning import timed_loop  # the same timed, lean task loop (sibling script)
from hydra import compose, initialize_config_dir

from fedlightning.clients.temporal_prompt import score_segment
from fedlightning.config import build
from fedlightning.federation.task_loop import TaskLoop
from fedlightning.programs.temporal_program import check_families, temporal_inputs
from fedlightning.resources import conf_dir
from fedlightning.server.reliability import read_broadcast
from fedlightning.temporal.adapter import PromptAdapter, event_context

CONF = str(conf_dir())
ROWS = {
    "zero_shot": ["algorithm=zero_shot"],
    "fedtip_residual": ["algorithm=fedtip", "algorithm.template=residual"],
    "fedtip_paper": ["algorithm=fedtip", "algorithm.template=paper"],
    # the paper-budget setting (one shared bottleneck of width 1, rank 1, the paper's template)
    "fedtip_budget": ["algorithm=fedtip_budget"],
    # ten times Adam's step: does an adapter that moves further help?
    "fedtip_residual_lr1e-2": [
        "algorithm=fedtip",
        "algorithm.template=residual",
        "algorithm.lr=0.01",
    ],
    "fedtip_paper_lr1e-2": ["algorithm=fedtip", "algorithm.template=paper", "algorithm.lr=0.01"],
}
METRICS = ("val_auc_tlp", "auc_tlp", "auc_ilp", "val_auc_nc", "auc_nc")


def config(stream: str, tasks: int, overrides: list[str]):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(
            "train",
            overrides=[f"experiment=temporal_{stream}", "logger=none", f"max_tasks={tasks}"]
            + overrides,
        )


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.reshape(-1).double() for _, v in sorted(state.items())])


@torch.no_grad()
def diagnostics(adapter: PromptAdapter, batch: dict, family: str) -> dict[str, float]:
    """Gate statistics (Eqs. 14-15) on a segment and, for link prediction, the template's
    share of the score and the score's correlation with the bank's (module docstring)."""
    adapter.eval()
    b = batch
    ok = b["mask"] & (b["neg_ok"] if family == "lp" else b["y"] >= 0)
    z = event_context(b["h_u"], b["h_i"], b["te"], b["x"], b["r_u"], b["r_i"])
    a_f, a_t = (g[ok] for g in adapter.gates(z))
    out = {
        "gate_f_mean": float(a_f.mean()),
        "gate_f_spread": float(a_f.mean(-1).std()),
        "gate_t_mean": float(a_t.mean()),
        "gate_t_spread": float(a_t.mean(-1).std()),
    }
    if family != "lp":
        return out
    shares, ours, bank = [], [], []
    for side in ("i", "j"):
        h_v = b[f"h_{side}"]
        a_f, a_t = adapter.gates(
            event_context(b["h_u"], h_v, b["te"], b["x"], b["r_u"], b[f"r_{side}"])
        )
        gated = a_f * torch.cat([b["h_u"], h_v], -1)
        learned = adapter.psi(torch.cat([gated, a_t * b["te"], b["x"]], -1))
        template = gated[..., : adapter.d_h] if adapter.residual else torch.zeros_like(learned)
        unit = F.normalize(h_v, dim=-1)
        t, ell = (template * unit).sum(-1)[ok], (learned * unit).sum(-1)[ok]
        shares.append(t.abs() / (t.abs() + ell.abs()).clamp_min(1e-12))
        ours.append(F.cosine_similarity(template + learned, h_v, dim=-1)[ok])
        bank.append(F.cosine_similarity(b["h_u"], h_v, dim=-1)[ok])
    out["template_share"] = float(torch.cat(shares).mean())
    out["corr_with_bank"] = float(
        np.corrcoef(torch.cat(ours).numpy(), torch.cat(bank).numpy())[0, 1]
    )
    return out


def run_row(stream: str, tasks: int, name: str, shared: dict) -> dict:
    """One row: the loop's per-task metrics, with the records of the module docstring."""
    cfg = config(stream, tasks, ROWS[name])
    alg = build(cfg.algorithm, "algorithm")
    record: dict = {"dist": {}, "gates": {}, "norm0": {}, "init_auc_tlp": {}}
    current: dict = {}

    class Loop(TaskLoop):
        def new_adapter(self, task, family):
            a = super().new_adapter(task, family)
            current.update(
                key=(task.task, family), init={k: v.clone() for k, v in a.state_dict().items()}
            )
            record["dist"][current["key"]] = []
            return a

    def task_work(context, task, family, module, broadcast):
        shapes = {n: (1, *v.shape[1:]) for n, v in module.adapter.state_dict().items()}
        omega, _ = read_broadcast(broadcast, shapes)
        gap = flat(omega) - flat(current["init"])
        record["dist"][(task.task, family)].append(float(gap.norm()))
        return type(alg).task_work(alg, context, task, family, module, broadcast)

    plain_evaluate = score_segment

    def evaluate(adapter, prototypes, batch, family):
        if isinstance(adapter, PromptAdapter) and batch is shared["evals"]["test"]:
            key = current["key"]
            final = adapter.state_dict()
            record["dist"][key].append(float((flat(final) - flat(current["init"])).norm()))
            record["norm0"][key] = float(flat(current["init"]).norm())
            start = PromptAdapter(**adapter.config)
            start.load_state_dict(current["init"])
            if family == "lp":  # the untrained adapter's score (r = 0)
                record["init_auc_tlp"][key] = plain_evaluate(start, {}, batch, family)["auc_tlp"]
            record["gates"][key] = {
                "init": diagnostics(start, batch, family),
                "final": diagnostics(adapter, batch, family),
            }
        return plain_evaluate(adapter, prototypes, batch, family)

    if name != "zero_shot":
        alg.task_work = task_work
    alg.task_scores = evaluate  # the server's scores, with the records above
    results, seconds = timed_loop(alg, cfg, shared, loop_cls=Loop)
    return {"results": results, "record": record, "seconds": seconds}


def mean_2se(values: list[float]) -> tuple[float, float, int]:
    v = np.array([x for x in values if not math.isnan(x)], dtype=np.float64)
    if len(v) == 0:
        return math.nan, math.nan, 0
    se = v.std(ddof=1) / math.sqrt(len(v)) if len(v) > 1 else math.nan
    return float(v.mean()), float(2 * se), len(v)


def summarize(rows: dict, families: list[str]) -> dict:
    zero = {r["task"]: r for r in rows["zero_shot"]["results"]}
    out = {}
    for name, row in rows.items():
        res = row["results"]
        s: dict = {"seconds": row["seconds"], "tasks": len(res)}
        for k in METRICS:
            if k not in res[0]:
                continue
            m, e, n = mean_2se([r[k] for r in res])
            d, de, _ = mean_2se([r[k] - zero[r["task"]][k] for r in res])
            s[k] = {"mean": m, "two_se": e, "n": n, "minus_zero_shot": d, "minus_two_se": de}
        rec = row["record"]
        if rec["init_auc_tlp"]:
            m, e, n = mean_2se(list(rec["init_auc_tlp"].values()))
            s["untrained_auc_tlp"] = {"mean": m, "two_se": e, "n": n}
        for fam in families:
            curves = [v for (t, f), v in rec["dist"].items() if f == fam and v]
            if not curves:
                continue
            norm0 = np.mean([v for (t, f), v in rec["norm0"].items() if f == fam])
            curve = np.mean(np.array(curves), 0)
            s[f"{fam}_distance_per_round"] = [float(x) for x in curve]
            s[f"{fam}_relative_distance_final"] = float(curve[-1] / norm0)
            gates = [g for (t, f), g in rec["gates"].items() if f == fam]
            s[f"{fam}_gates"] = {
                when: {k: float(np.mean([g[when][k] for g in gates])) for k in gates[0][when]}
                for when in ("init", "final")
            }
        out[name] = s
    return out


def table(stream: str, summary: dict) -> str:
    lines = [f"\n{stream}: mean over tasks +- 2 SE; [minus zero-shot, paired per task, +- 2 SE]"]
    for name, s in summary.items():
        cells = []
        for k in METRICS:
            if k in s:
                c = s[k]
                cells.append(f"{k} {c['mean']:.4f}+-{c['two_se']:.4f}")
                if name != "zero_shot":
                    cells[-1] += f" [{c['minus_zero_shot']:+.4f}+-{c['minus_two_se']:.4f}]"
        lines.append(f"  {name:22s} {'  '.join(cells)}  ({s['seconds']:.0f} s)")
        if "untrained_auc_tlp" in s:
            u = s["untrained_auc_tlp"]
            lines.append(
                f"    untrained adapter (r = 0) auc_tlp {u['mean']:.4f}+-{u['two_se']:.4f}"
            )
        for fam in ("lp", "nc"):
            if f"{fam}_distance_per_round" in s:
                d = s[f"{fam}_distance_per_round"]
                g = s[f"{fam}_gates"]
                pick = [0, 1, 5, 10, len(d) - 1]
                lines.append(
                    f"    {fam}: |Omega_r - Omega_0| at r={pick}: "
                    + ", ".join(f"{d[i]:.4f}" for i in pick)
                    + f" (final/|Omega_0| {s[f'{fam}_relative_distance_final']:.4f})"
                )
                for when in ("init", "final"):
                    lines.append(
                        f"    {fam} gates {when:5s}: "
                        + "  ".join(f"{k} {v:.4f}" for k, v in g[when].items())
                    )
    return "\n".join(lines)


def markdown(report: dict) -> str:
    """The tables of docs/fedtip.md ("Does the adapter learn?") from the JSON report."""
    out = [
        "| stream | row | val T-LP | test T-LP | I-LP | val NC | test NC "
        "| test T-LP minus zero-shot | r=0 T-LP |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for stream, rows in report["streams"].items():
        for name, s in rows.items():

            def cell(k: str, s: dict = s) -> str:
                return f"{s[k]['mean']:.3f} ± {s[k]['two_se']:.3f}" if k in s else "-"

            diff = "-"
            if name != "zero_shot":
                c = s["auc_tlp"]
                diff = f"{c['minus_zero_shot']:+.3f} ± {c['minus_two_se']:.3f}"
            out.append(
                f"| {stream} | {name} | {cell('val_auc_tlp')} | {cell('auc_tlp')} | "
                f"{cell('auc_ilp')} | {cell('val_auc_nc')} | {cell('auc_nc')} | {diff} | "
                f"{cell('untrained_auc_tlp')} |"
            )
    out += [
        "",
        "| stream | row | family | dist r=1 | r=5 | r=10 | r=20 | r=20 / norm(init) "
        "| gate_f mean (spread), init -> final | gate_t mean (spread), init -> final "
        "| template share | corr. with bank |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for stream, rows in report["streams"].items():
        for name, s in rows.items():
            for fam in ("lp", "nc"):
                if f"{fam}_distance_per_round" not in s:
                    continue
                d, g = s[f"{fam}_distance_per_round"], s[f"{fam}_gates"]
                i, f = g["init"], g["final"]
                gf = (
                    f"{i['gate_f_mean']:.3f} ({i['gate_f_spread']:.4f}) -> "
                    f"{f['gate_f_mean']:.3f} ({f['gate_f_spread']:.4f})"
                )
                gt = (
                    f"{i['gate_t_mean']:.3f} ({i['gate_t_spread']:.4f}) -> "
                    f"{f['gate_t_mean']:.3f} ({f['gate_t_spread']:.4f})"
                )
                share = (
                    f"{i['template_share']:.2f} -> {f['template_share']:.2f}"
                    if "template_share" in f
                    else "-"
                )
                corr = (
                    f"{i['corr_with_bank']:.2f} -> {f['corr_with_bank']:.2f}"
                    if "corr_with_bank" in f
                    else "-"
                )
                out.append(
                    f"| {stream} | {name} | {fam} | {d[1]:.3f} | {d[5]:.3f} | {d[10]:.3f} | "
                    f"{d[-1]:.3f} | {s[f'{fam}_relative_distance_final']:.3f} | {gf} | {gt} | "
                    f"{share} | {corr} |"
                )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", nargs="+", default=["bitcoin_alpha", "wikipedia"])
    ap.add_argument("--tasks", type=int, default=20)
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--out", default="docs/claims/fedtip_learning.json")
    ap.add_argument("--markdown", help="only print the tables of this JSON report")
    args = ap.parse_args()
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return
    torch.set_num_threads(1)
    report = {"tasks": args.tasks, "streams": {}}
    for stream in args.streams:
        cfg = config(stream, args.tasks, [])
        inputs = temporal_inputs(cfg)
        shared = {
            "tasks": inputs["tasks"],
            "evals": inputs["evals"],
            "dims": inputs["dims"],
            "families": check_families(cfg.families, inputs["protocol"].stream),
            "encoder": inputs["encoder"],
            "protocol": inputs["protocol"],
        }
        rows = {name: run_row(stream, args.tasks, name, shared) for name in args.rows}
        summary = summarize(rows, shared["families"])
        print(table(stream, summary), flush=True)
        report["streams"][stream] = summary
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
