"""Command line: ``fedlightning train [overrides]`` (Hydra; ``-m`` for multirun)."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from fedlightning.errors import FedLightningError

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")

USAGE = """usage: fedlightning COMMAND [hydra overrides]

commands:
  train     run an experiment: fedlightning train experiment=fedavg_cora federation.rounds=20
            multirun:          fedlightning train -m seed=0,1,2
            resume:            fedlightning train resume=outputs/<experiment>/<run>
            show the config:   fedlightning train --cfg job
"""


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="train")
def _train(cfg: DictConfig) -> float:
    from fedlightning.train import train

    run_dir = HydraConfig.get().runtime.output_dir
    try:
        summary = train(cfg, run_dir)
    except FedLightningError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    metrics = summary["metrics"]
    objective = metrics.get("val_am", metrics.get("val_acc"))  # what a sweep optimizes
    return float("nan") if objective is None else float(objective)


def _resume_run_dir(args: list[str]) -> list[str]:
    """On ``resume=DIR``, keep the resuming invocation's Hydra files inside ``DIR/.resume``."""
    if any(a.startswith("resume=") and a != "resume=null" for a in args):
        ignored = [a for a in args if not a.startswith(("resume=", "runner", "logger", "hydra"))]
        if ignored:
            print(
                f"warning: a resumed run keeps its saved config; ignoring {' '.join(ignored)} "
                "(only runner.* and logger.* may change)",
                file=sys.stderr,
            )
    for a in args:
        if (
            a.startswith("resume=")
            and a != "resume=null"
            and not any(x.startswith("hydra.run.dir=") for x in args)
        ):
            return [
                *args,
                f"hydra.run.dir={a.split('=', 1)[1]}/.resume/${{now:%Y-%m-%d_%H-%M-%S-%f}}",
            ]
    return args


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    command, rest = args[0], args[1:]
    if command != "train":
        print(f"error: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    sys.argv = [f"{Path(sys.argv[0]).name} train", *_resume_run_dir(rest)]
    _train()
