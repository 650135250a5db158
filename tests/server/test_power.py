"""POWER's equations (docs/fedogl.md, "POWER"), each against a hand computation, and its
server reconstructing a prototype whose gradient matches the uploaded one."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch_geometric.data import Data

from fedlightning.messages import ClientUpdate
from fedlightning.methods.power.power_client import (
    coverage_max,
    fused_input,
    power_objective,
    pseudo_graph,
)
from fedlightning.methods.power.power_server import (
    COUNT_PREFIX,
    GRAD_PREFIX,
    PowerMemory,
    batched_lbfgs,
    class_gradient,
    distillation_loss,
    distillation_weights,
    ge_parameters,
    gradient_distance,
    gradient_label,
    gradient_match,
    reconstruct_prototypes,
)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_ge_is_drawn_like_nn_linear_and_shared_by_seed():
    p = ge_parameters(10, 3, gen())
    assert [tuple(p[f"lin{i}.weight"].shape) for i in (1, 2, 3, 4)] == [
        (128, 10),
        (128, 128),
        (64, 128),
        (3, 64),
    ]
    for i, fan_in in zip((1, 2, 3, 4), (10, 128, 128, 64), strict=True):
        bound = 1 / math.sqrt(fan_in)
        assert p[f"lin{i}.weight"].abs().max() <= bound and p[f"lin{i}.bias"].abs().max() <= bound
    q = ge_parameters(10, 3, gen())
    assert all(torch.equal(p[k], q[k]) for k in p)  # the same seed: the same encoder


def test_label_is_the_argmin_of_the_last_bias_gradient():
    p = ge_parameters(6, 4, gen())
    x = torch.rand(6, generator=gen(1))
    for c in range(4):
        g = class_gradient(p, x, c)
        # dCE/db = softmax(z) - e_c, computed by hand from GE's logits
        h = x
        for i in (1, 2, 3):
            h = torch.relu(p[f"lin{i}.weight"] @ h + p[f"lin{i}.bias"])
        z = p["lin4.weight"] @ h + p["lin4.bias"]
        want = torch.softmax(z, 0) - torch.nn.functional.one_hot(torch.tensor(c), 4)
        assert torch.allclose(g["lin4.bias"], want, atol=1e-6)
        assert gradient_label(g) == c


def test_gradient_match_is_the_distance_of_autograds_class_gradients():
    p = ge_parameters(12, 4, gen())
    x = torch.randn(3, 12, generator=gen(1), dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 3, 1])
    uploads = [class_gradient(p, torch.rand(12, generator=gen(2 + i)), c) for i, c in enumerate((2, 3, 1))]  # fmt: skip
    targets = {k: torch.stack([u[k] for u in uploads]) for k in p}
    got = gradient_match(p, x, labels, targets)
    p64 = {k: v.double() for k, v in p.items()}
    for i in range(3):  # autograd's gradient, its distance, and the distance's gradient in x
        want = gradient_distance(
            class_gradient(p64, x[i], int(labels[i]), create_graph=True),
            {k: v.double() for k, v in uploads[i].items()},
        )
        assert float(got[i].detach()) == pytest.approx(float(want.detach()), rel=1e-9)
        (g_want,) = torch.autograd.grad(want, x, retain_graph=True)
        (g_got,) = torch.autograd.grad(got[i], x, retain_graph=True)
        assert torch.allclose(g_got, g_want, rtol=1e-8, atol=1e-12)


def test_batched_lbfgs_moves_one_problem_as_torch_lbfgs():
    a = torch.randn(6, 4, generator=gen(1), dtype=torch.float64)
    b = torch.randn(6, generator=gen(2), dtype=torch.float64)
    x0 = torch.randn(4, generator=gen(3), dtype=torch.float64)

    def f(x):
        return ((x @ a.T - b) ** 2).sum(-1) + (x**4).sum(-1)

    x = x0.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([x], lr=0.5, max_iter=7, tolerance_change=0.0, tolerance_grad=0.0)

    def closure():
        opt.zero_grad()
        loss = f(x)
        loss.backward()
        return loss

    opt.step(closure)
    ours = list(batched_lbfgs(f, x0.unsqueeze(0), 7, lr=0.5, tolerance_grad=0.0))
    assert [it for it, _ in ours] == list(range(7))
    assert torch.allclose(ours[-1][1][0], x.detach(), rtol=1e-10, atol=1e-12)


def test_server_reconstructs_prototypes_whose_gradients_match_the_uploads():
    p = ge_parameters(40, 5, gen())
    protos = (torch.rand(3, 40, generator=gen(2)) < 0.2).float() * 0.5  # bag-of-words means
    labels = torch.tensor([3, 0, 3])
    uploads = [class_gradient(p, protos[i], int(labels[i])) for i in range(3)]
    targets = {k: torch.stack([u[k] for u in uploads]) for k in p}
    start = torch.randn(3, 40, generator=gen(3))
    x = reconstruct_prototypes(p, targets, labels, start, steps=20)
    assert x.shape == (3, 1, 40)
    for i in range(3):
        c, target = int(labels[i]), uploads[i]
        norm = float(gradient_distance({k: v * 0 for k, v in target.items()}, target))
        assert float(gradient_distance(class_gradient(p, start[i], c), target)) > 1e-2 * norm
        assert float(gradient_distance(class_gradient(p, x[i, 0], c), target)) < 1e-6 * norm
        assert torch.nn.functional.cosine_similarity(x[i, 0], protos[i], 0) > 0.999
        # each upload is its own problem: solved alone, the same prototype
        alone = reconstruct_prototypes(p, {k: v[i : i + 1] for k, v in targets.items()},
                                       labels[i : i + 1], start[i : i + 1], steps=20)  # fmt: skip
        assert torch.allclose(alone[0, 0], x[i, 0], atol=1e-4)
    kept = reconstruct_prototypes(p, targets, labels, start, steps=20, keep=3)
    assert kept.shape == (3, 3, 40) and torch.equal(kept[:, -1], x[:, 0])


def test_distillation_weights_by_hand():
    counts = {
        0: {0: torch.tensor([2.0, 0, 0]), 1: torch.tensor([1.0, 3, 0])},
        1: {0: torch.tensor([0.0, 0, 4])},
    }
    w = distillation_weights(counts, 1, [0, 1], decay=0.5)
    # client 0: [0,0,4] + 0.5 [2,0,0] = [1,0,4]; client 1: 0.5 [1,3,0] = [0.5,1.5,0]
    want = torch.tensor([[1 / 1.5, 0.0, 1.0], [0.5 / 1.5, 1.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(w, want)
    assert torch.allclose(
        distillation_weights(counts, 0, [0, 1], 0.5)[:, 2], torch.zeros(2, dtype=torch.float64)
    )


def test_distillation_loss_by_hand():
    g = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    local = torch.tensor([[0.0, 2.0], [1.0, 1.0]])
    w = torch.tensor([[0.25, 1.0]])
    # node 0 (class 0): mean |.| = 0.5; node 1 (class 1): 1.0 -> 0.25 * 0.5 + 1.0 * 1.0
    assert float(distillation_loss(g, [local], w, torch.tensor([0, 1]))) == pytest.approx(1.125)


def test_coverage_max_by_hand():
    pts = [0.0, 0.1, 0.2, 5.0, 5.1, 10.0]
    mean = sum(abs(a - b) for a in pts for b in pts) / 36
    emb = torch.tensor(pts).unsqueeze(1)
    eta = 0.5 / mean  # cover radius 0.5: clusters {0, 1, 2}, {3, 4}, {5}
    # greedy: 0 covers 3 nodes, then 3 covers 2 (5 of 6 covered, < 90%), then 5 -> reset with
    # the chosen removed: 1 covers {1, 2}
    assert coverage_max(emb, 3, eta).tolist() == [0, 3, 5]
    assert coverage_max(emb, 4, eta).tolist() == [0, 3, 5, 1]
    assert coverage_max(emb, 9, eta).sort().values.tolist() == list(range(6))


def test_power_objective_by_hand():
    assert float(power_objective(torch.tensor(2.0), torch.tensor(4.0), 0.25)) == 3.5
    assert float(power_objective(torch.tensor(2.0), None, 0.25)) == 2.0


def test_fused_input_and_pseudo_graph_round_trip():
    data = Data(
        x_a=torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
        x_b=torch.tensor([[5.0], [6.0]]).to_sparse(),
        modality_mask=torch.tensor([[True, False], [True, True]]),
    )
    x = fused_input(data, ["a", "b"], torch.tensor([1, 0]))
    assert x.tolist() == [[3.0, 4.0, 6.0], [1.0, 2.0, 0.0]]
    g = pseudo_graph(x, {"a": 2, "b": 1})
    assert g.x_a.tolist() == [[3.0, 4.0], [1.0, 2.0]] and g.x_b.tolist() == [[6.0], [0.0]]
    assert g.edge_index.shape == (2, 0) and bool(g.modality_mask.all())


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, data: Data) -> torch.Tensor:
        return self.lin(data.x_a)


def test_memory_labels_counts_reconstructs_and_distills_toward_the_clients():
    torch.manual_seed(0)
    ge = ge_parameters(4, 3, gen())
    net = Tiny()
    mem = PowerMemory(
        net,
        lambda x: pseudo_graph(x, {"a": 4}),
        lambda: ge,
        lambda r: (r - 1) // 2,
        lambda r, k, j: gen(100 + k * 10 + j),
        epochs=50,
        lr=0.05,
        weight_decay=0.0,
    )
    protos = {0: torch.tensor([1.0, 0.0, 0.5, 0.0]), 1: torch.tensor([0.0, 1.0, 0.0, 0.5])}
    local = {k: v + 0.5 for k, v in net.state_dict().items()}  # the clients' model
    ups = []
    for cid, (c, n) in enumerate(((2, 7.0), (1, 3.0))):
        tensors = {f"model.{k}": v for k, v in local.items()}
        for k, g in class_gradient(ge, protos[cid], c).items():
            tensors[f"{GRAD_PREFIX}0.{k}"] = g
        ups.append(ClientUpdate(1, tensors, {"num_examples": 10.0, f"{COUNT_PREFIX}0": n}, cid))
    mem.aggregate(1, ups)
    assert mem.y.tolist() == [2, 1]  # labels inferred from the gradients alone
    assert torch.allclose(mem.x, torch.stack([protos[0], protos[1]]), atol=1e-3)
    assert mem.counts[0][0].tolist() == [0, 0, 7] and mem.counts[0][1].tolist() == [0, 3, 0]
    start = {k: v.clone() for k, v in net.state_dict().items()}
    g = pseudo_graph(mem.x, {"a": 4})

    def gap(state):
        out = torch.func.functional_call(net, state, (g,))
        return float((out - torch.func.functional_call(net, local, (g,))).abs().mean())

    new = mem.update_global(1, start)
    assert gap(new) < 0.5 * gap(start)  # pulled toward the clients' logits on pseudo-nodes
    again = PowerMemory(net, None, lambda: ge, lambda r: 0, None)
    again.load_state_dict(mem.state_dict())
    assert torch.equal(again.x, mem.x) and again.counts[0][1].tolist() == [0, 3, 0]


def power_message(alg, round: int, slots: int = 1, count: bool = True) -> ClientUpdate:
    """An honest POWER uplink of ``round``: the model, ``num_examples`` and ``slots`` class
    gradients of the run's GE, each with its count (unless ``count=False`` for the last)."""
    tensors = {"model.w": torch.zeros(2)}
    scalars = {"num_examples": 10.0}
    for j in range(slots):
        for k, g in class_gradient(alg.ge(), torch.ones(4), j).items():
            tensors[f"{GRAD_PREFIX}{j}.{k}"] = g
        if count or j < slots - 1:
            scalars[f"{COUNT_PREFIX}{j}"] = 3.0
    return ClientUpdate(round, tensors, scalars, 0)


def test_the_server_refuses_class_gradients_outside_a_stages_first_round_and_without_count():
    from fedlightning.messages import ServerBroadcast
    from fedlightning.methods.power.power import POWER
    from fedlightning.server.validation import validate

    alg = POWER()
    alg.dims, alg.classes, alg.rounds_per_stage, alg.seed = {"a": 4}, 3, 2, 0

    def check(u):
        return validate(u, alg.uplink(ServerBroadcast(u.round, {"model.w": torch.zeros(2)})))

    assert check(power_message(alg, 1, slots=2)) is None  # round 1 opens stage 0
    assert check(power_message(alg, 3)) is None  # round 3 opens stage 1
    assert check(power_message(alg, 2, slots=0)) is None  # FedAvg's message alone
    field, why = check(power_message(alg, 2))  # the stage's second round
    assert field.startswith(GRAD_PREFIX) and "undeclared" in why
    field, why = check(power_message(alg, 1, slots=2, count=False))
    assert field == f"{COUNT_PREFIX}1" and "count" in why
    u = power_message(alg, 1)
    del u.tensors[f"{GRAD_PREFIX}0.lin2.bias"]  # a slot carries all of GE's gradient
    assert check(u) == (
        f"{GRAD_PREFIX}0.lin2.bias",
        "missing (a slot carries all of GE's gradient)",
    )
    u = power_message(alg, 1, slots=2)
    u.scalars["num_examples"] = 5.0  # counts 3 + 3 > 5
    assert check(u)[0] == f"{COUNT_PREFIX}*"
    u = power_message(alg, 1)
    u.scalars[f"{COUNT_PREFIX}0"] = 2.5
    assert check(u) == (f"{COUNT_PREFIX}0", "2.5 is not a whole number")
    # without the server part nothing of POWER's is declared, even in a stage's first round
    alg.server_kd = False
    assert "undeclared" in check(power_message(alg, 1))[1]
