"""Recipes are protocol x dataset, the method chosen by ``algorithm=``; an older one-file-per-
method name is answered with its composed form, which composes the run of that name."""

from __future__ import annotations

import pytest

from fedlightning.config import build
from fedlightning.recipes import composed_form
from fedlightning.resources import conf_dir

EXPERIMENTS = sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))


def test_recipes_are_few_and_one_per_protocol_and_dataset():
    assert len(EXPERIMENTS) <= 30
    for protocol in ("fl", "cil", "cir", "temporal", "bank"):
        assert protocol in EXPERIMENTS  # a dataset-neutral recipe for a user's own data


@pytest.mark.parametrize(
    "old, new",
    [
        ("cil_fedogl_cora", ["experiment=cil_cora", "algorithm=fedogl"]),
        ("cil_fedavg_replay_citeseer_mm", ["experiment=cil_citeseer_mm", "algorithm=cil_fedavg_replay"]),
        ("cir_fedogl_citeseer_mm", ["experiment=cir_citeseer_mm", "algorithm=cir_fedogl"]),
        ("fedprox_cora", ["experiment=fl_cora", "algorithm=fedprox"]),
        ("fedtip_wikipedia", ["experiment=temporal_wikipedia", "algorithm=fedtip"]),
        ("bank_tgat_bitcoin_alpha", ["experiment=bank_bitcoin_alpha", "bank=tgat"]),
        ("fulltune_fedavg_wikipedia", ["experiment=temporal_wikipedia", "algorithm=fulltune_fedavg", "max_tasks=10"]),
        ("fedgcn_wikipedia", ["experiment=temporal_wikipedia", "algorithm=fedgcn", "families=auto"]),
        ("feddy_synthetic", ["experiment=temporal_synthetic", "algorithm=feddy", "max_tasks=3"]),
        ("cil_nothing_cora", None),
        ("demo", None),
        ("cil_cora", None),
    ],
)  # fmt: skip
def test_the_composed_form_of_an_older_name(old, new):
    assert composed_form(old, conf_dir()) == new


@pytest.mark.parametrize(
    "old",
    [
        "cil_fedogl_cora",
        "cil_fediih_citeseer_mm",
        "cil_prism_citeseer_mm",
        "cir_clipn_citeseer_mm",
        "fedavg_synthetic",
        "fedsage_plus_bitcoin_alpha",
        "prompt_central_wikipedia",
        "bank_tgn_synthetic",
    ],
)
def test_the_composed_form_names_the_run_as_before(old, compose):
    """The run keeps its name (the MLflow ``experiment`` tag, folder, reports' selection),
    and a method that needs its own net gets it from its algorithm config."""
    cfg = compose(composed_form(old, conf_dir()))
    assert cfg.name == old
    nets = {"cil_fediih": "DisentangledGNN", "cil_prism": "PrismNet", "cir_clipn": "CrossModalGNN"}
    for prefix, net in nets.items():
        if old.startswith(prefix):
            assert cfg.model.net._target_.endswith(net)


def test_a_command_line_model_wins_over_the_algorithms_own(compose):
    cfg = compose(["experiment=cil_cora", "algorithm=cil_fediih", "model=multimodal_gnn"])
    assert cfg.model.net._target_.endswith("MultimodalGNN")


def test_the_method_key_names_the_run_and_is_not_an_argument(compose):
    cfg = compose(["experiment=cil", "dataset=cora", "algorithm=cil_fedlwf"])
    assert cfg.name == "cil_fedlwf_cora" and cfg.algorithm.method == "fedlwf"
    assert type(build(cfg.algorithm, "algorithm")).__name__ == "ContinualFedAvg"
