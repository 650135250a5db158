"""FedTIP at the paper's message budget (``algorithm=fedtip_budget``): the shared bottleneck
of Eq. (17) and the message's float32 values, counted by hand against the ledger."""

import pytest
import torch

from fedlightning.clients.temporal_prompt import as_single
from fedlightning.config import build
from fedlightning.federation.executors import LeanExecutor
from fedlightning.federation.runners import SequentialRunner
from fedlightning.federation.task_loop import TaskBatches, TaskLoop
from fedlightning.methods.fedtip.fedtip import FedTIP
from fedlightning.temporal.adapter import PromptAdapter

D_H, D_T, D_E = 64, 64, 0  # the bank's widths; Bitcoin-Alpha and Wikipedia carry no x here
PAPER = 0.40 * 1024**2 / 4 / (5 * 20)  # 0.40 MiB per task over 5 clients x 20 rounds


def batch(n, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return {
        **{k: r(n, D_H) for k in ("h_u", "h_i", "h_j")},
        "te": r(n, D_T),
        "x": torch.zeros(n, D_E),
        **{k: r(n).abs() for k in ("r_u", "r_i", "r_j")},
        "y": torch.arange(n) % 2,
        "neg_ok": torch.ones(n, dtype=torch.bool),
        "inductive": torch.zeros(n, dtype=torch.bool),
    }


def budget(compose) -> FedTIP:
    return build(
        compose(["experiment=temporal_bitcoin_alpha", "algorithm=fedtip_budget"]).algorithm,
        "algorithm",
    )


def test_the_budget_message_is_counted_by_hand_in_the_ledger(compose):
    alg = budget(compose)
    assert (alg.name, alg.tie, alg.bottleneck, alg.rank) == ("fedtip_budget", "phi", 1, 1)
    tasks = [TaskBatches(0, {1: batch(6, 1), 2: batch(7, 2), 3: batch(5, 3)})]
    evals = {"val": as_single(batch(30, 8)), "test": as_single(batch(30, 9))}
    runner = SequentialRunner(LeanExecutor(), progress=False)
    loop = TaskLoop(
        alg, tasks, evals, ["nc", "lp"], (D_H, D_T, D_E), runner,
        rounds=2, epochs=2, seed=1, progress=False,
    )  # fmt: skip
    loop.run()
    d_z = 2 * D_H + D_T + D_E + 2  # Eq. (13): h_u, h_i, TE, x and two recencies
    phi = d_z * 1 + 1  # one shared bottleneck of width 1 (phi_f = phi_t)
    gates = (2 * D_H * 1 + 2 * D_H) + (D_T * 1 + D_T)  # W_f, b_f, W_t, b_t
    psi = (2 * D_H + D_T + D_E) * 1 + (1 * D_H + D_H)  # rank-1 template with its bias
    assert phi + gates + psi == 899
    message = 899 + 2 * D_H + 2 + 2  # delta, two prototypes and counts, coverage, norm
    assert message == 1031 <= PAPER
    assert loop.comm()["message_values"] == {"nc": message, "lp": message}
    assert alg.message_size(alg.adapter(D_H, D_T, D_E), "lp") == message
    # every client's uplink per round and family is its message (each saw both classes)
    up = loop.ledger.total("up", round=1, client=1, scope="task=0")
    assert up == 2 * message
    # the default adapter's message, for comparison: two bottlenecks of width 2, rank 2
    default = FedTIP().message_size(FedTIP().adapter(D_H, D_T, D_E), "lp")
    assert default == 2064


def test_tie_phi_shares_one_bottleneck_between_the_gates():
    torch.manual_seed(0)
    a = PromptAdapter(4, 3, 2, bottleneck=2, rank=2, tie="phi")
    assert a.phi_t is None and "phi_t.0.weight" not in a.state_dict()
    z = torch.randn(1, 5, 2 * 4 + 3 + 2 + 2)
    hidden = a.phi_f(z)
    a_f, a_t = a.gates(z)
    assert torch.equal(a_f, torch.sigmoid(a.gate_f(hidden)))
    assert torch.equal(a_t, torch.sigmoid(a.gate_t(hidden)))
    # the default keeps two bottlenecks and draws its parameters as before
    torch.manual_seed(0)
    b = PromptAdapter(4, 3, 2, bottleneck=2, rank=2)
    torch.manual_seed(0)
    c = PromptAdapter(4, 3, 2, bottleneck=2, rank=2, tie="none")
    assert b.phi_t is not None and all(
        torch.equal(b.state_dict()[k], v) for k, v in c.state_dict().items()
    )
    # a stacked copy keeps the tie
    assert a.stacked(3).phi_t is None and a.stacked(3).num_values() == a.num_values()
    with pytest.raises(ValueError, match="tie"):
        PromptAdapter(4, 3, 2, tie="psi")
    with pytest.raises(ValueError, match="algorithm.tie"):
        FedTIP(tie="both")
