"""FedTIP's prompt adapter and task losses (paper 001, Eqs. 13-21, 26) by hand."""

import math

import pytest
import torch

from fedlightning.temporal.adapter import (
    PromptAdapter,
    anchor_loss,
    class_prototypes,
    event_context,
    flat_start,
    link_loss,
    prototypical_loss,
    proximal_adapter,
    proximal_flat,
)


def inputs(n=3, d_h=4, d_t=3, d_e=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return r(n, d_h), r(n, d_h), r(n, d_t), r(n, d_e), r(n), r(n)


def test_event_context_eq13_order():
    h_u, h_i, te, x, du, di = inputs()
    z = event_context(h_u, h_i, te, x, du, di)
    assert z.shape == (3, 4 + 4 + 3 + 2 + 2)
    assert torch.equal(z[:, :4], h_u) and torch.equal(z[:, 8:11], te)
    assert torch.equal(z[:, -2], du) and torch.equal(z[:, -1], di)


def test_adapter_size_and_message_count_by_hand():
    a = PromptAdapter(d_h=4, d_t=3, d_e=2, bottleneck=2, rank=2)
    # d_z = 15: phi_f, phi_t 15*2+2 each; W_f 2*8+8; W_t 2*3+3; psi (8+3+2)*2 + 2*4+4
    assert a.num_values() == 32 + 32 + 24 + 9 + 26 + 12
    # + a 4-d prototype and a count per class (2 classes), coverage and norm
    from fedlightning.methods.fedtip.fedtip import FedTIP

    assert FedTIP().message_size(a, "nc", classes=2) == 135 + 2 * 5 + 2
    # without reliability weights no coverage or norm; the FedAvg prompt sends no
    # prototypes for link prediction (nothing on the server reads them)
    assert FedTIP(aggregation="fedavg").message_size(a, "lp") == 135 + 2 * 5
    assert FedTIP(aggregation="fedavg", anchors=False).message_size(a, "lp") == 135 + 2


def test_gates_decide_what_reaches_the_template():
    torch.manual_seed(0)
    a = PromptAdapter(d_h=4, d_t=3, d_e=2, template="paper")  # the template alone
    h_u, h_i, te, x, du, di = inputs()
    with torch.no_grad():
        # TE(t) enters the context, so it also modulates the feature gate (by design, the
        # gates read the same context): hold that gate constant to isolate the temporal one
        a.gate_f.weight.zero_()
        a.gate_f.bias.zero_()  # alpha_f = 0.5 for every event
        a.gate_t.weight.zero_()
        a.gate_t.bias.fill_(-50.0)  # temporal gate shut: TE(t) no longer matters
        out = a(h_u, h_i, te, x, du, di)
        assert torch.allclose(a(h_u, h_i, te * 7 + 1, x, du, di), out, atol=1e-6)
        assert not torch.allclose(a(h_u * 3, h_i, te, x, du, di), out)  # the states do
        a.gate_f.weight.zero_()
        a.gate_f.bias.fill_(-50.0)  # feature gate shut too: the states no longer matter
        out = a(h_u, h_i, te, x, du, di)
        assert torch.allclose(a(h_u * 3, h_i - 1, te, x, du, di), out, atol=1e-6)
        assert not torch.allclose(a(h_u, h_i, te, x + 1, du, di), out)  # x always enters psi
    static = PromptAdapter(d_h=4, d_t=3, d_e=2, static=True)
    g1 = static.gates(event_context(*inputs(seed=1)))
    g2 = static.gates(event_context(*inputs(seed=2)))
    assert all(torch.equal(p, q) for p, q in zip(g1, g2, strict=True))  # the event is ignored
    assert a(*inputs()).shape == (3, 4)  # d_p = d_h


def test_prototypes_and_prototypical_loss_eqs18_19():
    # client 0: three real events of classes 1, 1, 4 (and a padded row); client 1: one of
    # class 0 (its other classes absent: they take no part in its softmax)
    h = torch.tensor(
        [[[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [9.0, 9.0]], [[0.0, 5.0], [0, 0], [0, 0], [0, 0]]]
    )
    y = torch.tensor([[1, 1, 4, 4], [0, 0, 0, 0]])
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    q, counts = class_prototypes(h, y, mask, num_classes=5)
    assert counts.tolist() == [[0, 2, 0, 0, 1], [1, 0, 0, 0, 0]]
    assert torch.equal(q[0, 1], torch.tensor([2.0, 0.0])) and torch.equal(
        q[0, 4], torch.tensor([0.0, 2.0])
    )
    assert torch.equal(q[1, 0], torch.tensor([0.0, 5.0]))
    # client 0: every event has cos 1 with its own prototype and 0 with the other (tau = 1);
    # client 1: one class, log-softmax 0
    loss = prototypical_loss(h, y, mask, num_classes=5, tau=1.0)
    assert loss.item() == pytest.approx(3 * math.log(1 + math.exp(-1)))


def test_link_loss_and_proximal_eqs20_21_26():
    h = torch.tensor([[1.0, 0.0]])
    hi = torch.tensor([[1.0, 0.0]])  # cos 1
    hj = torch.tensor([[0.0, 1.0]])  # cos 0 with h
    expected = -math.log(math.exp(2) / (math.exp(2) + 1))  # tau = 0.5
    on = torch.tensor([True])
    assert link_loss(h, hi, h, hj, on, tau=0.5).item() == pytest.approx(expected)
    assert link_loss(h, hi, h, hj, ~on, tau=0.5).item() == 0.0  # a masked event adds nothing
    a = PromptAdapter(d_h=2, d_t=1, d_e=0)
    anchor = {n: p.detach().clone() for n, p in a.named_parameters()}
    assert proximal_adapter(a, anchor).item() == 0.0
    with torch.no_grad():
        a.gate_t.bias.add_(0.5)
    assert proximal_adapter(a, anchor).item() == pytest.approx(0.25)  # one 1-d bias moved 0.5
    assert proximal_flat(list(a.parameters()), flat_start(a, anchor)).item() == pytest.approx(0.25)


@pytest.mark.parametrize("family", ["nc", "lp"])
def test_flat_proximal_term_gives_the_per_parameter_gradient_bitwise(family):
    """The loss of Eq. (26) with the proximal term over one flat vector: every parameter's
    gradient (the task's and anchor's terms included) equals the per-parameter form's."""
    from fedlightning.clients.temporal_prompt import (
        FedTIPClient,
        family_prototypes,
        family_views,
        stack_batches,
        task_loss,
    )

    g = torch.Generator().manual_seed(3)
    batches = []
    for n in (5, 7, 6):
        b = dict(zip(("h_u", "h_i", "te", "x", "r_u", "r_i"), inputs(n, seed=n), strict=True))
        b.update(h_j=torch.randn(n, 4, generator=g), r_j=torch.randn(n, generator=g))
        b.update(y=torch.tensor([0, 1] * n)[:n], neg_ok=torch.ones(n, dtype=torch.bool))
        batches.append(b)
    stack = stack_batches(batches)
    single = PromptAdapter(d_h=4, d_t=3, d_e=2, dropout=0.1, template="paper")
    omega = {n: p.detach() + 0.1 for n, p in single.state_dict().items()}
    grads = []
    for flat in (True, False):
        module = FedTIPClient(single, family, lambda_p=0.5, lambda_a=0.3)
        module.receive(omega, {0: torch.ones(4), 1: -torch.ones(4)}, copies=3)
        torch.manual_seed(0)  # the same dropout draws
        if flat:
            loss = module.training_step(stack, 0)
        else:  # the per-parameter form of the same objective, in the same order
            v = family_views(module.adapter, stack, family)
            loss = task_loss(v, family, module.tau)
            loss = loss + module.lambda_p * proximal_adapter(module.adapter, module.start)
            q, n = family_prototypes(v, family)
            loss = loss + module.lambda_a * anchor_loss(q, n, module.anchors, module.has_anchor)
        loss.backward()
        grads.append([p.grad.clone() for p in module.adapter.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_anchor_loss_eq22_by_hand():
    q = torch.tensor([[[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]]])  # one client, classes 0, 1, 2
    counts = torch.tensor([[2.0, 1.0, 1.0]])
    anchors = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    has = torch.tensor([True, True, False])  # class 2: no anchor yet
    # rho = 2/4, 1/4 (n_k counts class 2 too); cos = 0 and 1/sqrt(2)
    expected = 0.5 * (1 - 0) + 0.25 * (1 - 1 / math.sqrt(2))
    assert anchor_loss(q, counts, anchors, has).item() == pytest.approx(expected)
    assert anchor_loss(q, counts, anchors, torch.zeros(3, dtype=torch.bool)).item() == 0.0
    # a second stacked client adds its own term; one without class 0 skips it
    q2 = torch.cat([q, torch.tensor([[[5.0, 0.0], [0.0, 3.0], [0.0, 0.0]]])])
    c2 = torch.cat([counts, torch.tensor([[0.0, 4.0, 0.0]])])
    assert anchor_loss(q2, c2, anchors, has).item() == pytest.approx(expected + 1.0)


def test_stacked_copies_are_independent_linear_maps():
    torch.manual_seed(0)
    a = PromptAdapter(d_h=4, d_t=3, d_e=2, copies=3)
    single = PromptAdapter(d_h=4, d_t=3, d_e=2)
    assert a.num_values() == single.num_values()  # per copy
    inputs_k = [inputs(seed=s) for s in range(3)]
    stacked = [torch.stack(v) for v in zip(*inputs_k, strict=True)]
    out = a(*stacked)
    for k in range(3):
        single.load_state_dict(a.copy_state(k))
        assert torch.allclose(out[k], single(*inputs_k[k]), atol=1e-6)
    b = single.stacked(2)
    assert all(torch.equal(p[0], p[1]) for p in b.parameters())


def test_template_carries_the_pretraining_similarity_residual():
    """With psi's low-rank map at zero, the prompted state is the gated source state: the
    score s(h~, h_i) of Eq. (20) is the bank's s(h_u, h_i) of Eq. (10)."""
    h_u, h_i, te, x, du, di = inputs()
    for residual in (True, False):
        a = PromptAdapter(d_h=4, d_t=3, d_e=2, template="residual" if residual else "paper")
        with torch.no_grad():
            for p in a.psi.parameters():
                p.zero_()
            a.gate_f.weight.zero_()
            a.gate_f.bias.zero_()  # alpha_f = 1/2
        out = a(h_u, h_i, te, x, du, di)
        assert torch.allclose(out, 0.5 * h_u if residual else torch.zeros_like(h_u))
    assert a.num_values() == PromptAdapter(d_h=4, d_t=3, d_e=2).num_values()  # no parameter
