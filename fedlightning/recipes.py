"""The composed form of a recipe name from before recipes were protocol x dataset.

An experiment is one protocol on one dataset (``cil_cora``, ``temporal_wikipedia``, ...) and the
method is chosen by ``algorithm=`` (docs/experiments.md). A name of the older, one-file-per-
method form (``cil_fedogl_cora``) is answered with the overrides that compose the same config,
budgets included, so a user's command, sweep file or note can be mended in one step."""

from __future__ import annotations

import re
from pathlib import Path

GRAPHS = ("cora", "citeseer_mm")
STREAMS = ("bitcoin_alpha", "wikipedia", "synthetic")
FL_METHODS = ("fedavg", "fedprox")
# (method, dataset) -> what its own recipe set beyond the protocol x dataset experiment
BUDGETS: dict[tuple[str, str], tuple[str, ...]] = {
    **{(m, "synthetic"): ("max_tasks=3",) for m in ("feddgl", "feddy", "stfl", "fulltune_fedavg")},
    **{("fulltune_fedavg", d): ("max_tasks=10",) for d in ("bitcoin_alpha", "wikipedia")},
    **{(m, "wikipedia"): ("families=auto",) for m in ("fedgcn", "fedsage_plus")},
}


def composed_form(name: str, conf_dir: str | Path) -> list[str] | None:
    """The overrides that compose what the recipe ``name`` of the older form composed
    (``cil_fedogl_cora`` -> ``experiment=cil_cora algorithm=fedogl``), or ``None`` when
    ``name`` is not such a name. ``conf_dir``: the configs, to tell the algorithms."""
    algorithms = Path(conf_dir) / "algorithm"

    def known(method: str) -> bool:
        return (algorithms / f"{method}.yaml").is_file()

    bank = re.fullmatch(r"bank_(tgn|tgat)_(\w+)", name)
    if bank and bank.group(2) in STREAMS:
        return [f"experiment=bank_{bank.group(2)}", f"bank={bank.group(1)}"]
    staged = re.fullmatch(rf"(cil|cir)_(\w+?)_({'|'.join(GRAPHS)})", name)
    if staged:
        protocol, method, data = staged.groups()
        method = f"{protocol}_{method}" if known(f"{protocol}_{method}") else method
        return [f"experiment={protocol}_{data}", f"algorithm={method}"] if known(method) else None
    plain = re.fullmatch(rf"(\w+?)_({'|'.join(GRAPHS + STREAMS)})", name)
    if plain and known(plain.group(1)):
        method, data = plain.groups()
        protocol = "fl" if method in FL_METHODS else "temporal"
        extra = BUDGETS.get((method, data), ())
        return [f"experiment={protocol}_{data}", f"algorithm={method}", *extra]
    return None


def recipe_overrides(name: str, conf_dir: str | Path) -> list[str]:
    """The overrides that run the recipe ``name``: ``experiment=<name>`` for a recipe of
    ``conf/experiment/``, else the composed form of an older name, else ``experiment=<name>``
    (which Hydra then refuses, naming the close ones). For scripts that take run names."""
    if (Path(conf_dir) / "experiment" / f"{name}.yaml").is_file():
        return [f"experiment={name}"]
    return composed_form(name, conf_dir) or [f"experiment={name}"]
