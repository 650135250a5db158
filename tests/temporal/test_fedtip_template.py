"""Eq. (16) as written (``algorithm.template=paper``) against the residual reading: a forward
computed by hand, the config keys (``template`` and its old name ``residual``), the
paper-budget setting's values, and both templates end to end on the synthetic stream."""

import math

import pytest
import torch

from fedlightning.config import build
from fedlightning.errors import ConfigError
from fedlightning.methods.fedtip.fedtip import FedTIP
from fedlightning.temporal.adapter import PromptAdapter
from fedlightning.train import train

SMALL = [
    "protocol.tasks.num_tasks=1",
    "federation.rounds=2",
    "federation.local_epochs=2",
    "bank.epochs=1",
    "bank.max_events=2000",
    "logger=none",
]


def hand_set(a: PromptAdapter) -> None:
    """d_h = d_t = d_e = 1, one bottleneck unit, rank 1 (d_z = 6: h_u, h_i, TE, x, r_u, r_i).
    phi_f reads r_u alone; W_f = [1, 0]^T, b_f = 0; the temporal gate is 1/2; psi's factors
    A = [1, 2, 3, 4] (no bias) and B = 2 with bias 1."""
    with torch.no_grad():
        for p in a.parameters():
            p.zero_()
        a.phi_f[0].weight[0, 0, 4] = 1.0
        a.gate_f.weight[0, 0, 0] = 1.0
        a.psi[0].weight[0] = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
        a.psi[1].weight[0, 0, 0] = 2.0
        a.psi[1].bias[0, 0] = 1.0


def test_paper_template_forward_by_hand():
    # h_u = 2, h_i = -1, TE = 4, x = 1, r_u = ln 3, r_i = 0.
    # phi_f = relu(ln 3) = ln 3; alpha_f = sigmoid([ln 3, 0]) = [3/4, 1/2]; alpha_t = 1/2.
    # psi's input [3/4 * 2, 1/2 * -1, 1/2 * 4, 1] = [1.5, -0.5, 2, 1]; A . = 10.5;
    # out = 2 * 10.5 + 1 = 22. The residual reading adds alpha_f,u * h_u = 1.5: 23.5.
    h_u, h_i, te, x = (torch.tensor([[v]]) for v in (2.0, -1.0, 4.0, 1.0))
    r_u, r_i = torch.tensor([math.log(3.0)]), torch.tensor([0.0])
    for template, expected in (("paper", 22.0), ("residual", 23.5)):
        a = PromptAdapter(1, 1, 1, bottleneck=1, rank=1, template=template).eval()
        hand_set(a)
        out = a(h_u, h_i, te, x, r_u, r_i)
        assert out.shape == (1, 1)
        assert out.item() == pytest.approx(expected, abs=1e-5), template


def test_paper_template_starts_off_the_bank_state_and_has_the_same_values():
    """Same seed: the same gates and first factor; only the residual zeroes psi's output
    factor (the paper's map starts as torch.nn.Linear), with the same number of values."""
    torch.manual_seed(0)
    res = PromptAdapter(4, 3, 2)
    torch.manual_seed(0)
    paper = PromptAdapter(4, 3, 2, template="paper")
    assert paper.num_values() == res.num_values()
    for (n, p), q in zip(res.named_parameters(), paper.parameters(), strict=True):
        if n.startswith("psi.1"):
            assert not p.any() and q.abs().sum() > 0
        else:
            assert torch.equal(p, q), n
    assert paper.stacked(2).config["template"] == "paper"
    with pytest.raises(ValueError, match="template must be one of"):
        PromptAdapter(4, 3, 2, template="lora")


def test_template_key_and_its_old_name(compose):
    def alg(*over):
        return build(
            compose(["experiment=temporal_synthetic", "algorithm=fedtip", *over]).algorithm,
            "algorithm",
        )

    assert alg().template == "residual" and alg().adapter(4, 3, 2).residual
    assert alg("algorithm.template=paper").adapter(4, 3, 2).residual is False
    assert alg("algorithm.residual=false").template == "paper"  # the old name still read
    assert alg("algorithm.residual=true").template == "residual"
    with pytest.raises(ConfigError, match="algorithm.residual"):
        alg("algorithm.template=paper", "algorithm.residual=true")
    with pytest.raises(ConfigError, match="algorithm.template must be one of"):
        alg("algorithm.template=lora")


def test_the_paper_budget_uses_the_paper_template_at_about_1050_values(compose):
    cfg = compose(["experiment=temporal_bitcoin_alpha", "algorithm=fedtip_budget"])
    alg = build(cfg.algorithm, "algorithm")
    assert alg.template == "paper"
    a = alg.adapter(64, 64, 0)
    # one shared phi (194 + 1), W_f, b_f (128 + 128), W_t, b_t (64 + 64), psi (192 + 64 + 64)
    assert a.num_values() == 195 + 256 + 128 + 320 == 899
    # + two 64-d prototypes, two counts, coverage and norm
    assert alg.message_size(a, "lp") == 899 + 2 * 65 + 2 == 1031
    assert FedTIP(template="paper").message_size(PromptAdapter(64, 64, 0), "lp") == 2064


@pytest.mark.parametrize("template", ["paper", "residual"])
def test_both_templates_run_end_to_end(env, compose, template):
    s = train(
        compose(
            [
                "experiment=temporal_synthetic",
                "algorithm=fedtip",
                f"algorithm.template={template}",
                *SMALL,
            ]
        ),
        env / template,
        verbose=False,
    )
    m = s["metrics"]
    assert s["tasks_done"] == 1 and 0.0 <= m["auc_tlp"] <= 1.0 and 0.0 <= m["auc_nc"] <= 1.0
    assert s["comm"]["uplink_values"] > 0
