"""What robust aggregation buys against sign-flipping clients, and what it costs on clean runs
(docs/security.md, "Robust aggregation").

Runs ``fedavg_cora`` in-process with the norm bound ``algorithm.max_update_norm`` for every
defence (``federation.robust``) and attack: clean, and 1 or 2 of the 5 clients sending the
sign-flipped update scaled to just under the norm bound (``w - 0.999 C d / ||d||`` for
their honest update ``d``). Prints one markdown row per (defence, attack): the mean test
accuracy over the seeds, its spread, the drop from the undefended clean run, the suspicious
clients flagged, and the mean round time. Clients fit one at a time
(``runner.stack_clients=false``) so that the attackers are injected by wrapping the
one-client fit, as tests/integration/test_hostile_runs.py does.

    PYTHONPATH=$PWD FEDLIGHTNING_DATA=<data root> python benchmarks/robust_aggregation.py \\
        --rounds 20 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

DEFENCES = {
    "none": "none",
    "median": "median",
    "trimmed_mean": "{rule: trimmed_mean, trim: 0.2}",
    "krum": "{rule: krum, byzantine: 2, keep: 3}",
    "screen": "{rule: screen, cosine: 0.0}",
    "screen_norm": "{rule: screen, cosine: 0.0, norm_ratio: 2.0}",
    "krum_keep4": "{rule: krum, byzantine: 1, keep: 4}",
    "screen_0.1": "{rule: screen, cosine: 0.1}",
    "auto": "auto",
    "screen_prev": "{rule: screen, reference: previous}",
    "centered_clip": "{rule: centered_clip}",
    "sign_0.5": "{rule: screen, measure: sign, relative: 0.5}",
    "sign_0.6": "{rule: screen, measure: sign, relative: 0.6}",
}


def flipper(attackers: set[int], bound: float):
    """A client fit whose update is turned around and scaled to ``0.999 bound`` for the
    clients in ``attackers``."""
    import fedlightning.federation.loop as loop_module
    from fedlightning.server.aggregate import model_state

    real = loop_module.local_fit

    def fit(algorithm, module, broadcast, executor, epochs, seed, client):
        update = real(algorithm, module, broadcast, executor, epochs, seed, client)
        if client.client_id not in attackers:
            return update
        start = model_state(broadcast.tensors)
        state = model_state(update.tensors)
        keys = [k for k, v in state.items() if v.is_floating_point()]
        norm = sum(float((state[k].double() - start[k].double()).pow(2).sum()) for k in keys) ** 0.5
        scale = -0.999 * bound / max(norm, 1e-12)
        for k in keys:
            update.tensors[f"model.{k}"] = (start[k] + scale * (state[k] - start[k])).to(
                state[k].dtype
            )
        return update

    return loop_module, real, fit


def run(overrides: list[str], out: Path, attackers: set[int], bound: float) -> dict[str, Any]:
    from fedlightning.config import compose
    from fedlightning.train import train

    loop_module, real, fit = flipper(attackers, bound)
    loop_module.local_fit = fit
    try:
        cfg = compose([*overrides, "logger=none", "runner.progress=false"])
        return train(cfg, out, verbose=False)
    finally:
        loop_module.local_fit = real


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--bound", type=float, default=10.0, help="algorithm.max_update_norm")
    p.add_argument("--defences", nargs="+", default=list(DEFENCES), choices=list(DEFENCES))
    p.add_argument("--attackers", type=int, nargs="+", default=[0, 1, 2])
    a = p.parse_args()
    base = [
        "experiment=fl_cora",
        "algorithm=fedavg",
        f"federation.rounds={a.rounds}",
        f"algorithm.max_update_norm={a.bound}",
        "runner.stack_clients=false",
    ]
    print("| defence | attack | test_acc (mean of seeds) | min-max | drop vs clean none | "
          "suspicious / run | round time (s) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    clean = None
    with tempfile.TemporaryDirectory() as d:
        for name in a.defences:
            for n in a.attackers:
                accs, flagged, times = [], [], []
                for seed in a.seeds:
                    over = [*base, f"federation.robust={DEFENCES[name]}", f"seed={seed}"]
                    out = Path(d) / f"{name}-{n}-{seed}"
                    s = run(over, out, set(range(n)), a.bound)
                    accs.append(s["metrics"]["test_acc"])
                    flagged.append(s["metrics"].get("suspicious", 0.0))
                    times.append(s["timing"].get("s_per_round", float("nan")))
                mean = statistics.fmean(accs)
                if name == "none" and n == 0:
                    clean = mean
                drop = "-" if clean is None else f"{clean - mean:+.3f}"
                attack = "clean" if n == 0 else f"sign flip {n} of 5"
                print(f"| {name} | {attack} | {mean:.3f} | {min(accs):.3f}-{max(accs):.3f} | "
                      f"{drop} | {statistics.fmean(flagged):.1f} | "
                      f"{statistics.fmean(times):.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
