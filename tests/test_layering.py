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

# The layers, top to bottom: a module imports only from its own layer or the layers below it.
# Every top-level module and folder of the package is in exactly one layer.
LAYERS: list[tuple[str, ...]] = [
    ("__main__", "cli", "completion", "train", "flower.apps"),  # entry: what a user starts
    ("flower", "sweeps", "report"),  # programs over runs: Flower's node side, studies, tables
    ("programs",),  # one program per kind of run: graph, temporal, bank, manifest
    ("methods",),  # one folder per method; a method may build on another (no cycles)
    ("federation",),  # the round, the schedules, runners, ledger: imports no method
    ("runs",),  # the run wrapper: directory, identity, checkpoint formats, tags, summary
    ("clients",),  # LightningModules two or more methods share
    ("server",),  # aggregation, screening, secure sums: never Lightning
    ("temporal",),  # encoders, the bank, contexts, the adapter
    ("models",),
    ("metrics",),
    ("tracking",),
    ("config", "recipes"),
    ("data",),
    ("resources",),
    ("messages", "objectives"),
    ("errors",),
    ("utils",),
]
ENTRY = {f"fedlightning.{m}" for m in LAYERS[0]}


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


def test_no_two_modules_share_a_basename():
    names: dict[str, list[str]] = {}
    for p in PACKAGE.rglob("*.py"):
        if p.name not in ("__init__.py", "__main__.py"):
            names.setdefault(p.name, []).append(str(p.relative_to(REPO)))
    assert not {k: v for k, v in names.items() if len(v) > 1}


def test_the_import_reader_sees_imports_inside_functions():
    # train.py imports its config checks and the run wrapper lazily; the reader must see them
    assert "fedlightning.config" in MODULES["fedlightning.train"]
    assert "fedlightning.runs" in MODULES["fedlightning.programs.graph_program"]


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module`` (the longest matching entry wins)."""
    best, found = -1, None
    for i, tops in enumerate(LAYERS):
        for top in tops:
            name = f"fedlightning.{top}"
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, found = len(name), i
    assert found is not None, f"{module} is in no layer of LAYERS"
    return found


def upward_arrows(modules: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{src} -> {dst}"
        for src, deps in modules.items()
        if src != "fedlightning"
        for dst in deps
        if dst in modules and dst != "fedlightning" and layer_of(dst) < layer_of(src)
    )


def test_every_module_is_in_a_layer():
    for module in MODULES:
        if module != "fedlightning":
            layer_of(module)


def test_no_module_imports_a_layer_above_its_own():
    bad = upward_arrows(MODULES)
    assert not bad, bad


@pytest.mark.parametrize(
    "src, dst",
    [
        ("fedlightning.metrics.diagnostics", "fedlightning.methods.fedogl.basis"),
        ("fedlightning.runs", "fedlightning.federation.ledger"),
        ("fedlightning.federation.task_loop", "fedlightning.methods.fedtip.fedtip"),
        ("fedlightning.data.partition", "fedlightning.federation.loop"),
    ],
)
def test_a_planted_upward_arrow_is_caught(src, dst, monkeypatch):
    monkeypatch.setitem(MODULES, src, MODULES[src] | {dst})
    assert upward_arrows(MODULES) == [f"{src} -> {dst}"]


def test_methods_import_each_other_without_cycles():
    graph = {
        m: {d for d in deps if d.startswith("fedlightning.methods.") and d in MODULES}
        for m, deps in MODULES.items()
        if m.startswith("fedlightning.methods.")
    }
    done: set[str] = set()

    def visit(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, f"import cycle: {' -> '.join((*path, m))}"
        if m not in done:
            for d in graph.get(m, ()):
                visit(d, (*path, m))
            done.add(m)

    for m in graph:
        visit(m, ())


def test_the_server_never_imports_lightning():
    servers = [*(PACKAGE / "server").rglob("*.py"), *(PACKAGE / "methods").rglob("*_server.py")]
    for path in servers:
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [n for n in names if n.split(".")[0] in ("lightning", "pytorch_lightning")], path


# ---------------------------------------------------------------------------- the map
ARCHITECTURE = REPO / "docs" / "architecture.md"
PATH = re.compile(r"(?<![\w/.])((?:fedlightning|conf|tests|benchmarks|tools|docs)/[\w./-]*[\w/])")


def named_paths() -> set[str]:
    return set(PATH.findall(ARCHITECTURE.read_text()))


def test_every_path_the_architecture_names_exists():
    missing = sorted(p for p in named_paths() if not (REPO / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_every_module_of_the_package_is_in_the_architecture():
    """Every module is named, or (a method's parts) its method's folder is."""
    named = named_paths()
    modules = sorted(
        str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"
    )
    unnamed = [m for m in modules if m not in named and m.rsplit("/", 1)[0] + "/" not in named]
    assert not unnamed, f"docs/architecture.md does not name: {unnamed}"
