"""Start-up cost of the package against ``import torch, torch_geometric``, side by side.

Each statement runs in a fresh interpreter (``python -c``), the statements interleaved, so
that every repetition sees the same machine load; the figures are medians over the
repetitions of the wall time and of the CPU time (user + system) of the child process. The
ratio is against the first statement, ``import torch, torch_geometric``: the least a run of
this package can import. ``fedlightning.train`` is what ``fedlightning train`` imports before it
reads the config; a graph run then imports its program, ``fedlightning.programs.graph_program``
(PyG, Lightning, the loop), measured too when the package has it.

    python benchmarks/startup.py [--repeats 7] [--path DIR] [--modules]

``--path`` puts a directory first on ``PYTHONPATH`` (a copy of the package with a change to
try); ``--modules`` also lists which heavy optional modules each statement leaves imported.
``FEDLIGHTNING_LEAN_IMPORTS=0`` in the environment measures the start-up without the guard of
``fedlightning/utils/lean_imports.py``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

STATEMENTS = {
    "torch + torch_geometric": "import torch, torch_geometric",
    "torch (for reference)": "import torch",
    "fedlightning.train": "import fedlightning.train",
    "fedlightning.cli": "import fedlightning.cli",
}
# a run's program, after ``fedlightning.train``: measured when the package has it
PROGRAMS = {"graph run (program)": "fedlightning.programs.graph_program"}

# What a lean start-up leaves alone: imported only by the code that uses it.
HEAVY = (
    "transformers",
    "sentence_transformers",
    "flwr",
    "ray",
    "matplotlib",
    "matplotlib.pyplot",
    "mlflow",
    "optuna",
    "scipy.signal",
    "torch_geometric.llm",
    "torchvision",
    "networkx",
    "pandas",
    "lightning",
    "torch_geometric",
)


# the children run in an empty directory: ``python -c`` puts its working directory first on
# ``sys.path``, which would shadow ``--path`` with a checkout's own package
CWD = tempfile.mkdtemp(prefix="startup-")


def run_once(statement: str, env: dict[str, str]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system) of ``python -c statement``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], env=env, cwd=CWD, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def has_module(module: str, env: dict[str, str]) -> bool:
    """Whether the ``fedlightning`` that ``env`` imports has the submodule ``module``."""
    *parts, last = module.split(".")[1:]
    probe = (
        "import os, sys, fedlightning\n"
        f"path = os.path.join(os.path.dirname(fedlightning.__file__), *{parts!r}, {last!r})\n"
        "sys.exit(not (os.path.isfile(path + '.py') or os.path.isdir(path)))"
    )
    return subprocess.run([sys.executable, "-c", probe], env=env, cwd=CWD).returncode == 0


def heavy_modules(statement: str, env: dict[str, str]) -> list[str]:
    """Which of ``HEAVY`` are in ``sys.modules`` after ``statement``."""
    probe = f"{statement}\nimport sys\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=CWD, check=True, capture_output=True, text=True
    )
    return out.stdout.split()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--path", default=None, help="prepended to PYTHONPATH")
    parser.add_argument("--modules", action="store_true", help="list heavy modules left imported")
    args = parser.parse_args(argv)

    env = dict(os.environ)
    if args.path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.path, env.get("PYTHONPATH")]))
    statements = dict(STATEMENTS)
    for name, module in PROGRAMS.items():
        if has_module(module, env):
            statements[name] = f"import fedlightning.train, {module}"

    for statement in statements.values():  # warm the file cache and the bytecode
        run_once(statement, env)
    walls: dict[str, list[float]] = {name: [] for name in statements}
    cpus: dict[str, list[float]] = {name: [] for name in statements}
    for _ in range(args.repeats):
        for name, statement in statements.items():
            wall, cpu = run_once(statement, env)
            walls[name].append(wall)
            cpus[name].append(cpu)

    base = next(iter(STATEMENTS))
    base_wall = statistics.median(walls[base])
    base_cpu = statistics.median(cpus[base])
    print(f"python {sys.version.split()[0]}, {args.repeats} repetitions, medians")
    print(f"{'import':<26} {'wall s':>8} {'cpu s':>8} {'x wall':>7} {'x cpu':>7}")
    for name in statements:
        wall = statistics.median(walls[name])
        cpu = statistics.median(cpus[name])
        print(f"{name:<26} {wall:8.2f} {cpu:8.2f} {wall / base_wall:7.2f} {cpu / base_cpu:7.2f}")
    if args.modules:
        print("heavy modules left imported:")
        for name, statement in statements.items():
            print(f"  {name:<24} {' '.join(heavy_modules(statement, env)) or '-'}")


if __name__ == "__main__":
    main()
