"""What robust aggregation buys against hostile clients, and what it costs on clean runs
(docs/security.md, "Robust aggregation").

Runs a recipe (``fedavg_cora``, or ``cil_fedogl_cora`` with ``--recipe``) in-process with
the norm bound ``algorithm.max_update_norm`` for every defence (``federation.robust``) and
attack (:data:`ATTACKS`): clean; 1 or 2 of the 5 clients sending the sign-flipped update
scaled to just under the norm bound (``w - 0.999 C d / ||d||`` for their honest update
``d``); that update claiming ``num_examples=1e12``; the honest update times 1000; or
training on labels shifted by one class; or absent (their fits fail every round: the
floor a defence that sets the attackers aside can reach). Prints one markdown row per (defence, attack):
the mean metric over the seeds (test accuracy, or FedOGL's average accuracy ``am``), its
spread, the drop from the undefended clean run (``--clean`` gives its mean when that run
is not in the list), the clients set aside and rejected, and the mean round time. Clients
fit one at a time (``runner.stack_clients=false``) so that the attackers are injected by
wrapping the one-client fit, as tests/integration/test_hostile_runs.py does.

    PYTHONPATH=$PWD FEDLIGHTNING_DATA=<data root> python benchmarks/robust_aggregation.py \\
        --rounds 20 --seeds 0 1 2 --defences none auto --attacks clean flip1 flip2
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
    "sign_0.7": "{rule: screen, measure: sign, relative: 0.7}",
}


RECIPES = {
    "fedavg_cora": (["experiment=fl_cora", "algorithm=fedavg"], "test_acc"),
    "cil_fedogl_cora": (["experiment=cil_cora", "algorithm=fedogl"], "am"),
}
# attack -> (hostile clients, what each sends): ``flip`` its update turned around at 0.999 of
# the norm bound; ``inflate`` that and ``num_examples=1e12``; ``scale`` its update 1000x (the
# norm bound clips it); ``labels`` trains on its training labels shifted by one class (y + 1 mod C);
# ``absent`` sends nothing (its fit fails every round): what a defence that sets the attackers
# aside every round can at best reach
ATTACKS = {
    "clean": (0, None),
    "flip1": (1, "flip"),
    "flip2": (2, "flip"),
    "inflate": (1, "inflate"),
    "scale": (1, "scale"),
    "labels": (1, "labels"),
    "absent1": (1, "absent"),
    "absent2": (2, "absent"),
}
NAMES = {
    "clean": "clean",
    "flip1": "sign flip 1 of 5",
    "flip2": "sign flip 2 of 5",
    "inflate": "sign flip + num_examples 1e12, 1 of 5",
    "scale": "update x1000, 1 of 5",
    "labels": "labels flipped, 1 of 5",
    "absent1": "1 of 5 absent (its fit fails)",
    "absent2": "2 of 5 absent (their fits fail)",
}


def spoiled(update: Any, broadcast: Any, kind: str, bound: float) -> Any:
    """``update`` as an attacker of ``kind`` sends it (``flip``, ``inflate``, ``scale``)."""
    from fedlightning.server.aggregate import model_state

    start = model_state(broadcast.tensors)
    state = model_state(update.tensors)
    keys = [k for k, v in state.items() if v.is_floating_point()]
    norm = sum(float((state[k].double() - start[k].double()).pow(2).sum()) for k in keys) ** 0.5
    scale = 1000.0 if kind == "scale" else -0.999 * bound / max(norm, 1e-12)
    for k in keys:
        update.tensors[f"model.{k}"] = (start[k] + scale * (state[k] - start[k])).to(state[k].dtype)
    if kind == "inflate":
        update.scalars["num_examples"] = 1e12
    return update


def attacked(attackers: set[int], kind: str | None, bound: float):
    """Patch the one-client fit (and, for ``labels``, the clients' data) so that the
    clients in ``attackers`` attack as ``kind``; returns the undo."""
    import fedlightning.federation.loop as loop_module
    import fedlightning.programs.graph_program as program

    real_fit, real_clients = loop_module.local_fit, program.build_clients

    def fit(algorithm, module, broadcast, executor, epochs, seed, client):
        if client.client_id in attackers and kind == "absent":
            raise RuntimeError("absent: this client's fit fails")
        update = real_fit(algorithm, module, broadcast, executor, epochs, seed, client)
        if client.client_id not in attackers or kind in (None, "labels"):
            return update
        return spoiled(update, broadcast, kind, bound)

    def clients(graph, partition):
        out = real_clients(graph, partition)
        for c in out:
            if c.client_id in attackers:  # its training labels only (it is scored honestly)
                y, train = c.data.y.clone(), c.data.train_mask
                y[train] = (y[train] + 1) % graph.num_classes
                c.data.y = y
        return out

    loop_module.local_fit = fit
    if kind == "labels":
        program.build_clients = clients

    def undo() -> None:
        loop_module.local_fit, program.build_clients = real_fit, real_clients

    return undo


def run(
    overrides: list[str], out: Path, attackers: set[int], kind: str | None, bound: float
) -> dict[str, Any]:
    from fedlightning.config import compose
    from fedlightning.train import train

    undo = attacked(attackers, kind, bound)
    try:
        cfg = compose([*overrides, "logger=none", "runner.progress=false"])
        return train(cfg, out, verbose=False)
    finally:
        undo()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="fedavg_cora", choices=list(RECIPES))
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--bound", type=float, default=10.0, help="algorithm.max_update_norm")
    p.add_argument("--defences", nargs="+", default=list(DEFENCES), choices=list(DEFENCES))
    p.add_argument(
        "--attacks", nargs="+", default=["clean", "flip1", "flip2"], choices=list(ATTACKS)
    )
    p.add_argument(
        "--clean", type=float, default=None, help="the undefended clean mean, for the drop"
    )
    a = p.parse_args()
    recipe, metric = RECIPES[a.recipe]
    base = [
        *recipe,
        f"federation.rounds={a.rounds}",
        f"algorithm.max_update_norm={a.bound}",
        "runner.stack_clients=false",
    ]
    print(f"| defence | attack | {metric} (mean of seeds) | min-max | drop vs clean none | "
          "suspicious / run | rejected / run | round time (s) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    clean = a.clean
    with tempfile.TemporaryDirectory() as d:
        for name in a.defences:
            for attack in a.attacks:
                n, kind = ATTACKS[attack]
                accs, flagged, rejected, times = [], [], [], []
                for seed in a.seeds:
                    over = [*base, f"federation.robust={DEFENCES[name]}", f"seed={seed}"]
                    out = Path(d) / f"{name}-{attack}-{seed}"
                    s = run(over, out, set(range(n)), kind, a.bound)
                    accs.append(s["metrics"][metric])
                    flagged.append(s["comm"].get("suspicious", {}).get("count", 0))
                    rejected.append(s["comm"].get("rejected", {}).get("count", 0))
                    times.append(s["timing"].get("s_per_round", float("nan")))
                mean = statistics.fmean(accs)
                if name == "none" and attack == "clean" and clean is None:
                    clean = mean
                drop = "-" if clean is None else f"{clean - mean:+.3f}"
                print(f"| {name} | {NAMES[attack]} | {mean:.3f} | {min(accs):.3f}-{max(accs):.3f} | "
                      f"{drop} | {statistics.fmean(flagged):.1f} | "
                      f"{statistics.fmean(rejected):.1f} | "
                      f"{statistics.fmean(times):.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
