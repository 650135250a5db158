"""DyGPrompt's module (fedlightning/methods/dygprompt): the dual prompts and dual condition-nets
computed by hand on a tiny input, the identity start, the stacked verbs FedTIP's loop calls,
the message size, and one-line refusals."""

import math

import pytest
import torch

from fedlightning.errors import ConfigError
from fedlightning.methods.dygprompt.dygprompt import DyGPrompt
from fedlightning.methods.dygprompt.dygprompt_client import DyGPromptClient
from fedlightning.methods.dygprompt.dygprompt_model import DyGPromptModule


def hand_module() -> DyGPromptModule:
    """d_h = d_t = 2, bottleneck 1, every weight set by hand:
    p_node = (2, -1), p_time = (0.5, 1);
    TCN: hidden relu(f1 - f2), output (1, 2) * hidden + (0.5, 0);
    NCN: hidden relu(x1 - x2 + 0.5), output (-1, 1) * hidden + (1, 1)."""
    m = DyGPromptModule(2, 2, bottleneck=1)
    with torch.no_grad():
        m.p_node.copy_(torch.tensor([[2.0, -1.0]]))
        m.p_time.copy_(torch.tensor([[0.5, 1.0]]))
        m.tcn[0].weight.copy_(torch.tensor([[[1.0, -1.0]]]))
        m.tcn[0].bias.copy_(torch.tensor([[0.0]]))
        m.tcn[3].weight.copy_(torch.tensor([[[1.0], [2.0]]]))
        m.tcn[3].bias.copy_(torch.tensor([[0.5, 0.0]]))
        m.ncn[0].weight.copy_(torch.tensor([[[1.0, -1.0]]]))
        m.ncn[0].bias.copy_(torch.tensor([[0.5]]))
        m.ncn[3].weight.copy_(torch.tensor([[[-1.0], [1.0]]]))
        m.ncn[3].bias.copy_(torch.tensor([[1.0, 1.0]]))
    return m.eval()


# Two events, by hand (x = p_node * h, f = p_time * te, x_tv = TCN(f) * x, f_tv = NCN(x) * f):
# h = (1, 2), te = (2, -2): x = (2, -2), f = (1, -2); TCN hidden relu(1 + 2) = 3, TCN(f) =
#   (3.5, 6), x_tv = (7, -12); NCN hidden relu(2 + 2 + 0.5) = 4.5, NCN(x) = (-3.5, 5.5),
#   f_tv = (-3.5, -11); h_tv = x_tv + f_tv = (3.5, -23).
# h = (0, 1), te = (1, 1): x = (0, -1), f = (0.5, 1); TCN hidden relu(-0.5) = 0, TCN(f) =
#   (0.5, 0), x_tv = (0, 0); NCN hidden relu(0 + 1 + 0.5) = 1.5, NCN(x) = (-0.5, 2.5),
#   f_tv = (-0.25, 2.5); h_tv = (-0.25, 2.5).
H = torch.tensor([[1.0, 2.0], [0.0, 1.0]])
TE = torch.tensor([[2.0, -2.0], [1.0, 1.0]])
EXPECTED = torch.tensor([[3.5, -23.0], [-0.25, 2.5]])


def test_both_conditional_prompts_by_hand():
    m = hand_module()
    zeros = torch.zeros(2)
    out = m(H, torch.zeros(2, 2), TE, torch.zeros(2, 0), zeros, zeros)
    assert torch.allclose(out, EXPECTED)
    # the time-conditioned node prompt alone and the node-conditioned time prompt alone
    x, f = m.p_node * H, m.p_time * TE
    assert torch.allclose(m.tcn(f) * x, torch.tensor([[7.0, -12.0], [0.0, 0.0]]))
    assert torch.allclose(m.ncn(x) * f, torch.tensor([[-3.5, -11.0], [-0.25, 2.5]]))


def test_link_views_prompt_the_source_the_destination_and_the_negative_at_the_event_time():
    m = hand_module()
    other = torch.tensor([[0.0, 1.0], [1.0, 2.0]])  # the two inputs of EXPECTED, swapped
    batch = {
        "h_u": H.unsqueeze(0), "h_i": other.unsqueeze(0), "h_j": H.unsqueeze(0),
        "te": TE.unsqueeze(0), "y": torch.tensor([[0, 1]]),
        "mask": torch.tensor([[True, True]]), "neg_ok": torch.tensor([[True, False]]),
    }  # fmt: skip
    h_pos, h_i, h_neg, h_j, mask = m.views(batch, "lp")
    assert torch.allclose(h_pos[0], EXPECTED) and torch.equal(h_neg, h_pos)
    assert torch.allclose(h_j[0], EXPECTED)
    # (0, 1) at te (2, -2): x = (0, -1), f = (1, -2); TCN hidden relu(3) = 3 -> x_tv = (0, -6);
    # NCN hidden 1.5 -> f_tv = (-0.5, -5); (1, 2) at te (1, 1): x = (2, -2), f = (0.5, 1);
    # TCN hidden relu(-0.5) = 0 -> x_tv = (1, 0); NCN hidden 4.5 -> f_tv = (-1.75, 5.5)
    assert torch.allclose(h_i[0], torch.tensor([[-0.5, -11.0], [-0.75, 5.5]]))
    assert mask.tolist() == [[True, False]]
    h, y, mask = m.views(batch, "nc")
    assert torch.allclose(h[0], EXPECTED) and y.tolist() == [[0, 1]]


def test_the_identity_start_is_the_frozen_state():
    """init=identity: p_node = 1, p_time = 0, condition-nets at output 1, so every prompted
    node is its bank state and the scorer's cosine is the bank's own similarity."""
    torch.manual_seed(0)
    m = DyGPromptModule(8, 8, bottleneck=2, copies=3)
    h, te = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    assert torch.equal(m.prompted(h, te), h)
    # one step of the prompts moves it: the time prompt's gradient is NCN(x) * te != 0
    loss = m.prompted(h, te).square().sum()
    loss.backward()
    assert m.p_time.grad.abs().sum() > 0 and m.p_node.grad.abs().sum() > 0


def test_the_released_start_draws_xavier_prompts():
    torch.manual_seed(0)
    m = DyGPromptModule(64, 64, init="xavier")
    bound = math.sqrt(6 / 65)
    for p in (m.p_node, m.p_time):
        assert p.abs().max() <= bound and p.std() > bound / 4


def test_stacked_copies_and_the_message_size():
    torch.manual_seed(1)
    m = DyGPromptModule(64, 64, bottleneck=16, dropout=0.1)
    # per copy: two 64-wide prompts and two condition-nets 64 -> 16 -> 64 (weights and biases)
    assert m.num_values() == 2 * 64 + 2 * (64 * 16 + 16 + 16 * 64 + 64) == 4384
    s = m.stacked(3)
    assert s.copies == 3 and s.num_values() == 4384
    for k in range(3):
        assert all(torch.equal(v, m.state_dict()[n]) for n, v in s.copy_state(k).items())
    s.place(2, 5)
    with pytest.raises(ValueError, match="not among"):
        s.place(3, 5)
    alg = DyGPrompt(name="dygprompt_fedavg", bottleneck=16)
    assert alg.message_size(m, "lp") == 4384 + 2  # delta and two counts
    assert alg.message_size(m, "nc") == 4384 + 2 + 2 * 64  # and the prototypes
    client = alg.task_module(alg.adapter(64, 64, 8), "lp")
    assert isinstance(client, DyGPromptClient) and client.lambda_a == 0.0
    opt = client.configure_optimizers()
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 1e-3]
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == 4384


def test_bad_settings_fail_in_one_line():
    with pytest.raises(ValueError, match="must equal the state"):
        DyGPromptModule(64, 32)
    with pytest.raises(ValueError, match="init must be one of"):
        DyGPromptModule(8, 8, init="zeros")
    with pytest.raises(ConfigError, match="no anchor"):
        DyGPrompt(anchors=True)
    with pytest.raises(ConfigError, match="algorithm.init"):
        DyGPrompt(init="zeros")
    with pytest.raises(ConfigError, match="time encoding's width"):
        DyGPrompt().adapter(64, 32, 0)


def test_a_stack_of_clients_is_their_separate_fits():
    """One stacked step over three clients' supports gives each copy the gradient its own
    single-copy loss gives it (the loss is a sum over clients; padding is masked)."""
    from fedlightning.clients.temporal_prompt import stack_batches

    torch.manual_seed(3)
    sizes = (4, 6, 5)
    batches = [
        {
            "h_u": torch.randn(n, 8), "h_i": torch.randn(n, 8), "h_j": torch.randn(n, 8),
            "te": torch.randn(n, 8), "y": torch.randint(0, 2, (n,)),
            "neg_ok": torch.ones(n, dtype=torch.bool),
        }
        for n in sizes
    ]  # fmt: skip
    base = DyGPromptModule(8, 8, bottleneck=3, init="xavier")
    for family in ("lp", "nc"):
        stack = DyGPromptClient(base.stacked(3), family)
        stack.training_step(stack_batches(batches), 0).backward()
        for k, b in enumerate(batches):
            one = DyGPromptClient(base.stacked(1), family)
            one.training_step(stack_batches([b]), 0).backward()
            pairs = zip(stack.adapter.named_parameters(), one.adapter.parameters(), strict=True)
            for (name, p), q in pairs:
                assert torch.allclose(p.grad[k], q.grad[0], atol=1e-6), (family, name, k)
