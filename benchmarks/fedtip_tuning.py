"""Equal-budget tuning on validation for the FedTIP side, then the best settings at three
protocol seeds on the test segment (docs/fedtip.md, "Tuned on validation (Table 3 style)").

``study``: one Optuna study per method and stream, read from a sweep file of
``sweeps/tuned/`` (the ``fedlightning sweep`` schema: experiment, overrides, space, objective,
trials, sampler, ``start_from_defaults``), run in this process on the cached bank and
contexts: every trial runs the task loop over the first ``max_tasks`` tasks of the manifest
(``protocol.seed`` of the experiment) and scores the mean validation AUC of the objective
(``val_auc_tlp``: the server's validation segment, Algorithm 1 line 17 of paper 001). The
sampler is the file's, seeded per trial as :func:`fedlightning.sweeps.make_sampler` seeds
it; trial 0 is the method's defaults. Writes ``docs/results/fedtip_tuned/studies/<file>.json``
(every trial's parameters, value and seconds; the best; the study's wall time)::

    python benchmarks/fedtip_tuning.py study --spec sweeps/tuned/fedtip_residual_bitcoin_alpha.yaml

``evaluate``: each study's best setting, and the zero-shot row (``algorithm=zero_shot``, the
frozen bank's template of Eq. 10, nothing to tune), at each ``--seeds`` protocol seed (the
manifest, ownership, tasks and negatives all change with it; the bank's own ``seed`` stays)
on ``--tasks`` tasks, link prediction. Writes one small JSON per (method, stream, protocol
seed) under ``docs/results/fedtip_tuned/eval/`` with the over-task means and stds and every
task's AUCs (for paired differences); ``tools/doc_tables.py`` makes the table from them::

    python benchmarks/fedtip_tuning.py evaluate --streams bitcoin_alpha --seeds 2026 2027 2028
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import optuna
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from fedlightning.config import build
from fedlightning.federation.executors import LeanExecutor
from fedlightning.federation.runners import SequentialRunner
from fedlightning.federation.task_loop import TaskLoop
from fedlightning.programs.temporal_program import check_families, temporal_inputs
from fedlightning.resources import conf_dir
from fedlightning.sweeps import experiment_setting, load_spec, make_sampler, suggest

CONF = str(conf_dir())
OUT = Path("docs/results/fedtip_tuned")
METRICS = ("val_auc_tlp", "auc_tlp", "auc_ilp")
_INPUTS: dict[tuple[str, int], dict] = {}


def compose_cfg(experiment: str, overrides: list[str]):
    """The experiment composed with ``overrides`` (no logger)."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("train", overrides=[f"experiment={experiment}", "logger=none", *overrides])


def inputs(experiment: str, protocol_seed: int) -> dict:
    """The cached bank's task batches and server segments for every task of the manifest
    drawn with ``protocol_seed`` (computed once per process)."""
    key = (experiment, protocol_seed)
    if key not in _INPUTS:
        cfg = compose_cfg(experiment, [f"protocol.seed={protocol_seed}", "families=[lp]"])
        got = temporal_inputs(cfg)
        got["families"] = check_families(cfg.families, got["protocol"].stream)
        _INPUTS[key] = got
    return _INPUTS[key]


def timed_loop(
    alg, cfg, shared: dict, tasks: int | None = None, loop_cls: type[TaskLoop] = TaskLoop
) -> tuple[list[dict], float]:
    """``loop_cls`` (a :class:`TaskLoop`) of ``alg`` over the first ``tasks`` tasks of the
    cached ``shared`` inputs, sequential and lean, with ``cfg``'s rounds, local epochs and
    seed: every task's metrics, and the seconds the loop ran. A published baseline's history
    view is attached and materialized first, as the training program does (not timed)."""
    alg.attach(shared["encoder"], shared["protocol"])
    alg.materialize_views(OmegaConf.to_container(cfg.protocol, resolve=True)["cache_dir"])
    loop = loop_cls(
        alg,
        list(shared["tasks"])[:tasks],
        shared["evals"],
        shared["families"],
        shared["dims"],
        SequentialRunner(LeanExecutor(), progress=False),
        rounds=int(cfg.federation.rounds),
        epochs=int(cfg.federation.local_epochs),
        seed=int(cfg.seed),
        progress=False,
    )
    t0 = time.perf_counter()
    results = loop.run()
    return results, time.perf_counter() - t0


def run_setting(cfg, shared: dict, tasks: int | None) -> tuple[list[dict], float]:
    """The task loop of ``cfg``'s algorithm over the first ``tasks`` tasks: every task's
    metrics, and the seconds it took."""
    return timed_loop(build(cfg.algorithm, "algorithm"), cfg, shared, tasks)


def overrides_of(params: dict) -> list[str]:
    return [f"{k}={v}" for k, v in params.items()]


def study(spec_path: str, out_dir: Path) -> dict:
    """One study (module docstring); returns and writes its record."""
    spec = load_spec(spec_path)
    base = [o for o in spec.overrides if not o.startswith("max_tasks=")]
    tasks = next((int(o.split("=")[1]) for o in spec.overrides if o.startswith("max_tasks=")), None)
    seed = int(compose_cfg(spec.experiment, base).protocol.seed)
    shared = inputs(spec.experiment, seed)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    st = optuna.create_study(direction=spec.direction, sampler=make_sampler(spec, 0))
    if spec.start_from_defaults:
        st.enqueue_trial(experiment_setting(spec, compose_cfg(spec.experiment, base)))
    trials, t_start = [], time.perf_counter()
    for number in range(spec.trials):
        st.sampler = make_sampler(spec, number)
        trial = st.ask()
        params = {k: suggest(trial, k, p) for k, p in spec.space.items()}
        cfg = compose_cfg(spec.experiment, [*base, *overrides_of(params)])
        results, seconds = run_setting(cfg, shared, tasks)
        value = float(np.mean([r[spec.metric] for r in results]))
        st.tell(trial, value)
        trials.append({"number": number, "params": params, "value": value, "seconds": seconds})
        print(f"{Path(spec_path).stem} trial {number}: {value:.4f} ({seconds:.0f} s) {params}")
    best = max(trials, key=lambda t: t["value"] * (1 if spec.direction == "maximize" else -1))
    record = {
        "spec": str(spec_path),
        "experiment": spec.experiment,
        "overrides": base,
        "tasks": tasks,
        "protocol_seed": seed,
        "metric": spec.metric,
        "trials": trials,
        "best": best,
        "default_value": trials[0]["value"] if spec.start_from_defaults else None,
        "wall_s": time.perf_counter() - t_start,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{Path(spec_path).stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def summary(results: list[dict]) -> dict:
    """Over-task mean and std (``ddof=1``) of each metric, and every task's value."""
    out = {}
    for k in METRICS:
        v = np.array([r[k] for r in results if k in r and not math.isnan(r[k])], dtype=np.float64)
        if len(v):
            out[k] = {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0}
            out[k]["per_task"] = [round(float(x), 5) for x in v]
    return out


def evaluate(
    streams: list[str],
    seeds: list[int],
    tasks: int | None,
    studies: Path,
    out_dir: Path,
    methods: list[str] | None = None,
    extra: list[str] | None = None,
) -> None:
    """Each study's best setting and the zero-shot row at every protocol seed (module
    docstring). ``extra``: ``NAME=METHOD:KEY=V,KEY=V`` rows, a study's best setting with
    these overrides on top (a module switched off at the tuned setting)."""
    for stream in streams:
        experiment = f"temporal_{stream}"
        rows = {"zero_shot": {"overrides": ["algorithm=zero_shot", "families=[lp]"], "params": {}}}
        for f in sorted(studies.glob(f"*_{stream}.json")):
            rec = json.loads(f.read_text())
            method = f.stem[: -len(stream) - 1]
            rows[method] = {"overrides": rec["overrides"], "params": rec["best"]["params"]}
        for spec in extra or []:
            name, rest = spec.split("=", 1)
            base, _, changes = rest.partition(":")
            if base not in rows:
                raise SystemExit(f"--extra {spec}: no study of {base!r} on {stream}")
            more = [c for c in changes.split(",") if c]
            rows[name] = {**rows[base], "overrides": [*rows[base]["overrides"]], "more": more}
        rows = {m: r for m, r in rows.items() if not methods or m in methods}
        for seed in seeds:
            shared = inputs(experiment, seed)
            for method, row in rows.items():
                ov = [*row["overrides"], *overrides_of(row["params"]), *row.get("more", [])]
                ov.append(f"protocol.seed={seed}")
                cfg = compose_cfg(experiment, ov)
                results, seconds = run_setting(cfg, shared, tasks)
                rec = {
                    "method": method,
                    "stream": stream,
                    "protocol_seed": seed,
                    "seed": int(cfg.seed),
                    "tasks": len(results),
                    "overrides": ov,
                    "seconds": round(seconds, 1),
                    "metrics": summary(results),
                }
                out = out_dir / f"{method}_{stream}_p{seed}.json"
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(rec, indent=0) + "\n")
                m = rec["metrics"]["auc_tlp"]
                print(f"{stream} p{seed} {method}: T-LP {m['mean']:.4f} +- {m['std']:.4f} "
                      f"({seconds:.0f} s)", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("study", help="one Optuna study per sweep file")
    s.add_argument("--spec", nargs="+", required=True)
    s.add_argument("--out", type=Path, default=OUT / "studies")
    e = sub.add_parser("evaluate", help="the best settings at several protocol seeds")
    e.add_argument("--streams", nargs="+", default=["bitcoin_alpha", "wikipedia"])
    e.add_argument("--seeds", nargs="+", type=int, default=[2026, 2027, 2028])
    e.add_argument("--tasks", type=int, default=None, help="the first N tasks (default: all)")
    e.add_argument("--studies", type=Path, default=OUT / "studies")
    e.add_argument("--out", type=Path, default=OUT / "eval")
    e.add_argument("--methods", nargs="+", help="only these rows (default: every study's)")
    e.add_argument("--extra", nargs="+", help="NAME=METHOD:KEY=V,KEY=V rows (evaluate's doc)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.cmd == "study":
        for spec in args.spec:
            study(spec, args.out)
    else:
        evaluate(
            args.streams, args.seeds, args.tasks, args.studies, args.out, args.methods, args.extra
        )


if __name__ == "__main__":
    main()
