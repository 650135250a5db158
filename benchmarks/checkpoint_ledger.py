"""The communication ledger's share of a checkpoint, round by round: the entries saved as one
list of tuples (before 2026-12-03) against :meth:`CommLedger.state_dict`'s pickled chunks,
each holding the entries recorded since the previous checkpoint.

A run checkpoints after every round, and the ledger grows by the round's messages, so the
list form costs each checkpoint time in proportion to the rounds so far (the run's
checkpoints, quadratic in its rounds). The entries are a real run's: ``--experiment`` runs
one round per stage (``logger=none``, in a temporary folder), and its rounds' entries are
recorded again, in order and as new objects, for ``--rounds`` rounds. Both forms are timed interleaved in one
process (``torch.save`` to memory, as a checkpoint does), and each line says whether the
packed form reloads to the same entries.

    FEDLIGHTNING_DATA=... python benchmarks/checkpoint_ledger.py [--rounds 80 200 500]
"""

from __future__ import annotations

import argparse
import io
import tempfile
import time
from itertools import cycle, groupby
from pathlib import Path

import torch

from fedlightning.federation.ledger import CommLedger, unpacked


def real_rounds(experiment: str) -> list[list[tuple]]:
    """The ledger entries of each round of a one-round-per-stage run of ``experiment``."""
    from hydra import compose, initialize_config_dir

    from fedlightning.resources import conf_dir
    from fedlightning.train import train

    overrides = [f"experiment={experiment}", "federation.rounds=1", "logger=none"]
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose("train", overrides=overrides)
    with tempfile.TemporaryDirectory() as tmp:
        train(cfg, tmp, verbose=False)
        state = torch.load(Path(tmp) / "checkpoint.pt", weights_only=False)["ledger"]
    entries = unpacked(state)["entries"]
    return [list(g) for _, g in groupby(entries, key=lambda e: e[1])]


def saved_seconds(obj: object) -> float:
    t = time.perf_counter()
    torch.save(obj, io.BytesIO())
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiment", default="cil_fedogl_citeseer_mm")
    ap.add_argument("--rounds", type=int, nargs="+", default=[80, 200, 500])
    args = ap.parse_args()
    torch.set_num_threads(1)
    template = real_rounds(args.experiment)
    per_round = sum(map(len, template)) / len(template)
    print(f"{args.experiment}: {len(template)} rounds run, {per_round:.0f} entries a round")
    print(
        f"{'rounds':>7} {'entries':>8} {'list: last':>11} {'total':>8} "
        f"{'packed: last':>13} {'total':>8} {'speed-up':>9}  same entries"
    )
    marks, todo = set(args.rounds), max(args.rounds)
    ledger, plain = CommLedger(), [0.0, 0.0]
    packed = [0.0, 0.0]
    rounds = cycle(template)
    for r in range(1, todo + 1):
        # new tuples and field names each round, as a run's messages make them (the same
        # objects again would let pickle's memo write them once)
        ledger.entries.extend(
            (d, r, c, "".join(field), v, b, scope) for d, _, c, field, v, b, scope in next(rounds)
        )
        plain[0] = saved_seconds({"entries": list(ledger.entries), "rejections": []})
        packed[0] = saved_seconds(ledger.state_dict())
        plain[1] += plain[0]
        packed[1] += packed[0]
        if r in marks:
            same = unpacked(ledger.state_dict())["entries"] == ledger.entries
            print(
                f"{r:>7} {len(ledger.entries):>8} {plain[0] * 1e3:>8.2f} ms {plain[1]:>7.2f}s "
                f"{packed[0] * 1e3:>10.2f} ms {packed[1]:>7.2f}s {plain[1] / packed[1]:>8.1f}x  "
                f"{same}"
            )


if __name__ == "__main__":
    main()
