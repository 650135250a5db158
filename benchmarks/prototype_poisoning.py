"""What FedTIP's prototype bound buys against a prototype poisoner (docs/security.md,
"Bounded influence").

``fedtip_synthetic`` shrunk to 3 tasks of 2 rounds (as tests/integration/test_hostile_runs.py
runs it), clean and with the highest client id of each round sending its prototypes times
-100 (counts honest), with the server's prototype bound on (``proto_norm_ratio=3``, the
default) and off. Prints the AUCs of each run.

    PYTHONPATH=$PWD python benchmarks/prototype_poisoning.py
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

SMALL = [
    "experiment=temporal_synthetic",
    "algorithm=fedtip",
    "protocol.tasks.num_tasks=3",
    "federation.rounds=2",
    "federation.local_epochs=2",
    "bank.epochs=1",
    "bank.max_events=2000",
    "logger=none",
    "task_workers=1",
]


def main() -> None:
    import fedlightning.server.reliability as rel
    from fedlightning.config import compose
    from fedlightning.methods.fedtip.fedtip import FedTIP
    from fedlightning.train import train

    real, init = FedTIP.make_updates, rel.FedTIPServer.__init__

    def spoiled(self, module, batch, start, round, client_ids, generators=None):
        out = real(self, module, batch, start, round, client_ids, generators)
        for u in out:
            if u.client_id == max(client_ids):
                for k in [k for k in u.tensors if k.startswith("proto.")]:
                    u.tensors[k] = -100 * u.tensors[k]
        return out

    print("| run | prototype bound | auc_nc | auc_tlp | auc_ilp |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        os.environ.setdefault("FEDLIGHTNING_CACHE", str(Path(d) / "cache"))
        for name, poison, ratio in [
            ("clean", False, 3.0),
            ("clean", False, None),
            ("one -100x poisoner a round", True, 3.0),
            ("one -100x poisoner a round", True, None),
        ]:
            FedTIP.make_updates = spoiled if poison else real

            def bounded(self, *a, _r=ratio, **k):
                k.setdefault("proto_norm_ratio", _r)
                init(self, *a, **k)

            rel.FedTIPServer.__init__ = bounded
            try:
                out = Path(d) / f"{name}-{ratio}".replace(" ", "_")
                m = train(compose(SMALL), out, verbose=False)["metrics"]
            finally:
                FedTIP.make_updates, rel.FedTIPServer.__init__ = real, init
            bound = "off" if ratio is None else "3x median"
            print(f"| {name} | {bound} | {m['auc_nc']:.4f} | {m['auc_tlp']:.4f} | "
                  f"{m['auc_ilp']:.4f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
