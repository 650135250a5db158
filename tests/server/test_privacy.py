"""The clipped Gaussian prototype release (Eqs. 4, 5, 7) and its budget
(fedlightning/server/privacy.py), against hand computations and dp-accounting called
directly."""

import pytest
import torch

from fedlightning.errors import ConfigError
from fedlightning.methods.fedogl.fedogl import FedOGL
from fedlightning.methods.fedtip.fedtip import FedTIP
from fedlightning.server.privacy import (
    PrototypeRelease,
    epsilon,
    private_prototype,
    release_sensitivity,
)


def test_release_clips_each_row_then_averages():
    h = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, -2.0]])
    # rows clipped to norm 1: [0.6, 0.8], [0.3, 0.4] (inside), [0, -1]; mean over n = 3: [0.9/3, 0.2/3]
    assert torch.allclose(private_prototype(h, 1.0, 0.0), torch.tensor([0.3, 0.2 / 3]), atol=1e-7)
    assert release_sensitivity(1.0, 3) == pytest.approx(2 / 3)


@pytest.mark.parametrize("n,clip,sigma", [(1, 1.0, 1.0), (4, 2.0, 0.5)])
def test_release_noise_scale_is_sigma_times_two_clip_over_n(n, clip, sigma):
    h = torch.zeros(n, 3)
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([private_prototype(h, clip, sigma, g) for _ in range(6000)])
    expected = sigma * 2 * clip / n  # Eq. (7) with Delta_2 = 2 C / n (Eq. 5)
    assert draws.std(0).tolist() == pytest.approx([expected] * 3, rel=0.05)
    assert draws.mean(0).abs().max() < 4 * expected / 6000**0.5


def test_epsilon_is_the_accountants_for_a_known_case():
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(1.0), 10)
    assert epsilon(1.0, 10, 1e-5) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
    # one release at sigma = 1: the classic Gaussian mechanism is within (1, 6) at 1e-5
    assert 1.0 < epsilon(1.0, 1, 1e-5) < 6.0


def test_epsilon_falls_with_sigma_and_grows_with_releases():
    eps = [epsilon(s, 20, 1e-5) for s in (0.5, 1.0, 2.0, 4.0)]
    assert all(a > b for a, b in zip(eps, eps[1:], strict=False))
    assert epsilon(1.0, 5) < epsilon(1.0, 50)
    assert epsilon(0.0, 5) == float("inf") and epsilon(1.0, 0) == 0.0


def test_settings_are_checked_and_reported():
    r = PrototypeRelease.from_settings({"clip": 1.0, "sigma": 2.0})
    b = r.budget(12)
    assert b["releases"] == 12 and b["delta"] == 1e-5
    assert b["epsilon"] == pytest.approx(epsilon(2.0, 12, 1e-5))
    assert PrototypeRelease.from_settings(None).budget(5)["epsilon"] == float("inf")
    for bad, key in (
        ({"clip": -1.0}, "algorithm.dp.clip"),
        ({"sigma": 1.0}, "algorithm.dp.sigma"),
        ({"clip": 1.0, "delta": 2.0}, "algorithm.dp.delta"),
        ({"clip": 1.0, "epsilon": 2.0}, "algorithm.dp.epsilon"),
    ):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            PrototypeRelease.from_settings(bad)


def test_fedtip_reads_the_new_keys_and_its_old_names():
    assert FedTIP(dp={"clip": 2.0, "sigma": 0.5}).release == PrototypeRelease(2.0, 0.5)
    assert FedTIP(clip=2.0, sigma=0.5).release == PrototypeRelease(2.0, 0.5)  # old names
    with pytest.raises(ConfigError, match="algorithm.dp.clip"):
        FedTIP(clip=1.0, dp={"clip": 2.0})
    tip = FedTIP(dp={"clip": 1.0, "sigma": 1.0})
    # 3 tasks x 2 rounds x the families that send prototypes (nc always; lp with anchors)
    assert tip.privacy_budget(3, 2, ["nc", "lp"])["releases"] == 12
    assert FedTIP(anchors=False, dp={"clip": 1.0}).privacy_budget(3, 2, ["lp"])["releases"] == 0


def test_fedogl_release_needs_one_mode_per_class():
    assert FedOGL(dp={"clip": 1.0, "sigma": 1.0}).privacy_budget(6)["releases"] == 6
    with pytest.raises(ConfigError, match="proto.modes=1"):
        FedOGL(dp={"clip": 1.0}, proto={"modes": 2})
