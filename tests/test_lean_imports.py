"""Lean start-up: what importing the package leaves in ``sys.modules``, in fresh interpreters.

Not timed: each check names the modules that must not be imported (see
``benchmarks/startup.py`` for the time), and that the packages hidden while PyG and
torchmetrics import (``fedlightning/utils/lean_imports.py``) work normally afterwards.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

# never imported by the start-up, nor by a graph run's modules before they are used
HEAVY = (
    "transformers",
    "sentence_transformers",
    "efficientnet_lite_pytorch",
    "flwr",
    "ray",
    "matplotlib",
    "matplotlib.pyplot",
    "mlflow",
    "optuna",
    "scipy.signal",
    "networkx",
)


def run_python(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object as its last line."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cli_and_train_import_nothing_heavy():
    got = run_python(
        f"""
        import json, sys
        heavy = {HEAVY!r}
        import fedlightning.cli
        cli = [m for m in heavy if m in sys.modules]
        import fedlightning.train
        train = [m for m in heavy if m in sys.modules]
        print(json.dumps({{"cli": cli, "train": train}}))
        """
    )
    assert got == {"cli": [], "train": []}


def test_a_config_error_is_told_before_torch_is_imported():
    """``train`` checks a graph run's config first: a value the config alone refutes costs
    no import of torch, PyG or Lightning (the error comes at once)."""
    got = run_python(
        """
        import json, sys
        from fedlightning.config import compose
        from fedlightning.errors import ConfigError
        from fedlightning.train import train
        try:
            train(compose(["federation.clients=0", "logger=none"]), "never_made")
        except ConfigError as e:
            error = str(e)
        heavy = ("torch", "torch_geometric", "lightning")
        print(json.dumps({"error": error, "imported": [m for m in heavy if m in sys.modules]}))
        """
    )
    assert "federation.clients" in got["error"] and got["imported"] == []


def test_pyg_and_lightning_import_without_their_optional_extras():
    """The modules of a graph run (PyG, Lightning, torchmetrics, the clients, metrics, data,
    tracking) leave the heavy optional packages alone; afterwards those import and work, the
    finder is gone, and a plot is drawn without pyplot."""
    got = run_python(
        f"""
        import json, sys, tempfile
        from pathlib import Path
        heavy = {HEAVY!r}
        import fedlightning.train
        import torch_geometric, torch_geometric.nn, lightning.pytorch, torchmetrics
        import fedlightning.clients, fedlightning.metrics, fedlightning.data.graphs
        import fedlightning.data.partition, fedlightning.tracking, fedlightning.tracking.plots
        from fedlightning.utils.lean_imports import LeanImportFinder
        left = [m for m in heavy if m in sys.modules]
        finder = any(isinstance(f, LeanImportFinder) for f in sys.meta_path)

        from lightning_utilities.core.imports import package_available
        import scipy.signal, torch
        from torchmetrics.functional.classification import binary_auroc
        auroc = float(binary_auroc(torch.tensor([0.9, 0.1, 0.8]), torch.tensor([1, 0, 1])))
        from fedlightning.tracking.plots import plot_curves
        png = Path(tempfile.mkdtemp()) / "curves.png"
        rows = [{{"round": r, "val_acc": 0.5, "train_loss": 1.0}} for r in range(3)]
        plot_curves(rows, png)
        print(json.dumps({{
            "left": left,
            "finder": finder,
            "auroc": auroc,
            "scipy_available": package_available("scipy"),
            "png": png.stat().st_size > 0,
            "pyplot": "matplotlib.pyplot" in sys.modules,
        }}))
        """
    )
    assert got["left"] == []
    assert got["finder"] is False
    assert got["auroc"] == 1.0
    assert got["scipy_available"] is True
    assert got["png"] is True
    assert got["pyplot"] is False


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers not installed"
)
def test_pyg_llm_models_still_import_transformers_when_used():
    """With the guard, PyG's LLM parts load transformers when used; without it (the switch),
    importing PyG alone imports transformers: the guard is what keeps it out."""
    got = run_python(
        """
        import json, sys
        import fedlightning, torch_geometric
        before = "transformers" in sys.modules
        from torch_geometric.llm.models import SentenceTransformer
        import transformers
        print(json.dumps({"before": before, "after": "transformers" in sys.modules}))
        """
    )
    assert got == {"before": False, "after": True}
    off = run_python(
        """
        import json, sys
        import fedlightning, torch_geometric
        print(json.dumps({"transformers": "transformers" in sys.modules}))
        """,
        FEDLIGHTNING_LEAN_IMPORTS="0",
    )
    assert off == {"transformers": True}
