"""The package's layers read top-down, and docs/architecture.md maps the package as it is.

Imports are read with ``ast`` (nothing is executed), including imports inside functions.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "fedlightning"

# The entry layer: commands and apps a user or Flower starts. Nothing else imports these.
ENTRY = {
    "fedlightning.train",
    "fedlightning.cli",
    "fedlightning.__main__",
    "fedlightning.flower.apps",
}
# Below the federation layer: data, models, metrics, server, clients and the shared pieces.
LOW = ("data", "models", "metrics", "server", "clients", "callbacks", "utils", "tracking")
LOW_SHARED = {"fedlightning.messages", "fedlightning.errors", "fedlightning.objectives"}
ABOVE_LOW = ("federation", "algorithms", "experiments", "flower", "runs", "train", "cli", "sweeps")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Every ``fedlightning`` module ``path`` imports (absolute, or relative resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = (
        module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    )
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # `from pkg import module`
    return {m for m in out if m == "fedlightning" or m.startswith("fedlightning.")}


MODULES = {module_name(p): imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def is_under(module: str, tops: tuple[str, ...]) -> bool:
    return any(
        module == f"fedlightning.{t}" or module.startswith(f"fedlightning.{t}.") for t in tops
    )


def arrows(source_pred, target_pred) -> list[str]:
    return sorted(
        f"{src} -> {dst}"
        for src, deps in MODULES.items()
        if source_pred(src)
        for dst in deps
        if target_pred(dst)
    )


def test_the_import_reader_sees_imports_inside_functions():
    # train.py imports its programs lazily; the reader must still see them
    assert "fedlightning.experiments.graph" in MODULES["fedlightning.train"]
    assert "fedlightning.runs" in MODULES["fedlightning.experiments.graph"]


def test_nothing_below_the_entry_point_imports_it():
    bad = arrows(lambda s: s not in ENTRY, lambda d: d in ENTRY)
    assert not bad, bad


def test_data_models_metrics_server_clients_import_no_upper_layer():
    bad = arrows(lambda s: is_under(s, LOW) or s in LOW_SHARED, lambda d: is_under(d, ABOVE_LOW))
    assert not bad, bad


def test_federation_does_not_import_algorithms_or_what_runs_it():
    above = ("algorithms", "experiments", "flower", "runs", "train", "cli", "sweeps")
    bad = arrows(lambda s: is_under(s, ("federation",)), lambda d: is_under(d, above))
    assert not bad, bad


def test_algorithms_do_not_import_the_programs_that_run_them():
    above = ("experiments", "flower", "runs", "train", "cli", "sweeps")
    bad = arrows(lambda s: is_under(s, ("algorithms",)), lambda d: is_under(d, above))
    assert not bad, bad


def test_the_server_never_imports_lightning():
    for path in (PACKAGE / "server").rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [n for n in names if n.split(".")[0] in ("lightning", "pytorch_lightning")], path


@pytest.mark.parametrize("src, dst", [("fedlightning.data.x", "fedlightning.federation.loop")])
def test_a_planted_wrong_arrow_is_caught(src, dst, monkeypatch):
    monkeypatch.setitem(MODULES, src, {dst})
    bad = arrows(lambda s: is_under(s, LOW) or s in LOW_SHARED, lambda d: is_under(d, ABOVE_LOW))
    assert bad == [f"{src} -> {dst}"]


# ---------------------------------------------------------------------------- the map
ARCHITECTURE = REPO / "docs" / "architecture.md"
PATH = re.compile(r"(?<![\w/.])((?:fedlightning|conf|tests|benchmarks|tools|docs)/[\w./-]*[\w/])")


def named_paths() -> set[str]:
    return set(PATH.findall(ARCHITECTURE.read_text()))


def test_every_path_the_architecture_names_exists():
    missing = sorted(p for p in named_paths() if not (REPO / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_module_of_the_package_is_in_the_architecture():
    named = named_paths()
    modules = sorted(
        str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"
    )
    unnamed = [m for m in modules if m not in named]
    assert not unnamed, f"docs/architecture.md does not name: {unnamed}"
