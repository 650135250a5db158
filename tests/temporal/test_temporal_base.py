"""The temporal base (``TemporalMethod``): FedTIP's baselines subclass it, not FedTIP; their
configs compose ``temporal_base.yaml`` and carry none of FedTIP's own settings; the hooks the
temporal program reads answer by hand-computed values; a baseline's run saved while its config
composed ``fedtip.yaml`` (FedTIP's keys in it) still builds on resume."""

from dataclasses import fields
from types import SimpleNamespace

import pytest
from omegaconf import open_dict

from fedlightning.config import build
from fedlightning.errors import ConfigError
from fedlightning.methods.fedtip.fedtip import FedTIP
from fedlightning.methods.temporal_base.temporal_base import TemporalMethod
from fedlightning.programs.temporal_program import make_algorithm
from fedlightning.server.privacy import PrototypeRelease

BASELINES = ["fedgnn", "fedlink", "feddy", "stfl", "feddgl", "fedgcn", "fedsage_plus", "zero_shot"]
FEDTIP_ONLY = {"lambda_p", "lambda_a", "beta", "eta_s", "prompt", "bottleneck", "rank",
               "template", "residual", "tie", "dp", "clip", "sigma", "prototype_bound"}  # fmt: skip
SHARED = {"mode", "aggregation", "anchors", "negatives", "tau", "lr", "weight_decay"}


def algorithm_cfg(compose, name, *extra):
    return compose(["experiment=temporal_synthetic", f"algorithm={name}", *extra])


@pytest.mark.parametrize("name", BASELINES)
def test_a_baseline_is_a_temporal_method_without_fedtip_settings(compose, name):
    cfg = algorithm_cfg(compose, name)
    algorithm = build(cfg.algorithm, "algorithm")
    assert isinstance(algorithm, TemporalMethod) and not isinstance(algorithm, FedTIP)
    assert not FEDTIP_ONLY & set(cfg.algorithm), sorted(FEDTIP_ONLY & set(cfg.algorithm))
    assert set(cfg.algorithm) >= SHARED


def test_fedtip_composes_the_base_and_keeps_its_own_settings(compose):
    cfg = algorithm_cfg(compose, "fedtip")
    assert SHARED | FEDTIP_ONLY - {"prototype_bound"} <= set(cfg.algorithm)
    assert (cfg.algorithm.aggregation, cfg.algorithm.anchors, cfg.algorithm.tau) == (
        "reliability",
        True,
        0.1,
    )
    assert isinstance(build(cfg.algorithm, "algorithm"), TemporalMethod)


def test_the_base_variant_names_the_bank_and_the_negatives():
    assert TemporalMethod().variant() == "full"
    assert TemporalMethod().variant(pretrained_bank=False) == "no_tkb"
    assert TemporalMethod(negatives="unfiltered").variant(False) == "no_tkb_ftn"
    assert TemporalMethod().variant(filtered_bank=False) == "no_ftn"


def test_the_base_refuses_fedtip_only_choices():
    with pytest.raises(ConfigError, match="algorithm.anchors"):
        TemporalMethod(anchors=True)
    with pytest.raises(ValueError, match="algorithm.aggregation"):
        TemporalMethod(aggregation="reliability")
    with pytest.raises(ValueError, match="algorithm.mode"):
        TemporalMethod(mode="central")


def test_the_base_message_size_by_hand():
    """delta (10 values) + 2 counts; nc adds 2 prototypes of d_h = 4."""
    adapter = SimpleNamespace(num_values=lambda: 10, d_h=4)
    base = TemporalMethod()
    assert base.message_fields("lp") == ("delta", "counts")
    assert base.message_size(adapter, "lp") == 12
    assert base.message_size(adapter, "nc") == 20
    # FedTIP's reliability adds coverage and norm, its anchors the prototypes on lp too
    assert FedTIP().message_size(adapter, "lp") == 22


def test_the_base_releases_nothing():
    base = TemporalMethod()
    assert not base.release.on
    expected = PrototypeRelease.from_settings({"delta": 1e-5}).budget(0)
    assert base.privacy_budget(3, 2, ["lp", "nc"]) == expected


def test_a_saved_baseline_config_with_fedtip_keys_resumes(compose, tmp_path):
    """A run saved when fedgnn.yaml composed fedtip.yaml: its FedTIP keys are dropped on
    resume (and only there); a FedTIP run's are its own."""
    cfg = algorithm_cfg(compose, "fedgnn")
    with open_dict(cfg):
        cfg.algorithm.update(lambda_a=0.1, beta=0.1, prompt="interaction", dp={"clip": None})
    with pytest.raises(ConfigError, match="algorithm"):
        make_algorithm(cfg)  # a fresh run: an unknown key is refused
    with open_dict(cfg):
        cfg.resume = str(tmp_path)
    algorithm = make_algorithm(cfg)
    assert type(algorithm).__name__ == "FedGNN" and algorithm.lr == 0.01
    assert "lambda_a" in cfg.algorithm  # the saved config itself is untouched (its identity)
    fedtip = algorithm_cfg(compose, "fedtip", "algorithm.beta=0.3")
    with open_dict(fedtip):
        fedtip.resume = str(tmp_path)
    assert make_algorithm(fedtip).beta == 0.3


def test_every_fedtip_setting_the_base_lacks_is_fedtip_only():
    base = {f.name for f in fields(TemporalMethod)}
    assert {f.name for f in fields(FedTIP)} - base == FEDTIP_ONLY | {"dropout"}


@pytest.mark.parametrize("name", ["fedgnn", "feddy", "fedgcn", "zero_shot", "fulltune_fedavg"])
def test_secure_sums_refuse_a_method_whose_server_sums_in_the_clear(compose, name):
    """Only FedTIP's task server sums masked shares (Eq. 6); a baseline under
    ``federation.secure_sum=true`` is refused in one line naming the key, not run in the
    clear."""
    algorithm = build(algorithm_cfg(compose, name).algorithm, "algorithm")
    with pytest.raises(ConfigError) as e:
        algorithm.use_secure_sum(0)
    assert e.value.key == "federation.secure_sum" and "\n" not in str(e.value)
    fedtip = build(algorithm_cfg(compose, "fedtip").algorithm, "algorithm")
    fedtip.use_secure_sum(7, 2.0)
    assert (fedtip.secure_seed, fedtip.max_update_norm) == (7, 2.0)


def test_the_shared_settings_alone_are_refused_as_no_method(compose):
    """``algorithm=temporal_base`` (listed beside the methods) is the settings they share:
    refused in one line that says so, not a traceback or a class name of OmegaConf's."""
    with pytest.raises(ConfigError) as e:
        make_algorithm(algorithm_cfg(compose, "temporal_base"))
    assert e.value.key == "algorithm" and "no _target_" in str(e.value)
