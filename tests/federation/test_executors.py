"""The lean loop and the Lightning Trainer give the same weights and call the same hooks."""

import copy
from functools import partial

import lightning.pytorch as pl
import pytest
import torch

from fedlightning.clients import NodeClassifier, proximal_term
from fedlightning.data.graphs import make_synthetic
from fedlightning.federation.executors import LeanExecutor, TrainerExecutor, with_foreach
from fedlightning.models import MultimodalGNN


class Recorder(pl.Callback):
    def __init__(self):
        self.calls = []
        self.grad_norms = []

    def on_fit_start(self, trainer, pl_module):
        self.calls.append("fit_start")

    def on_after_backward(self, trainer, pl_module):
        self.calls.append("after_backward")
        self.grad_norms.append(float(pl_module.net.head.weight.grad.norm()))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.calls.append("before_step")

    def on_train_epoch_end(self, trainer, pl_module):
        self.calls.append("epoch_end")


def _setup():
    g = make_synthetic(num_nodes=120, num_classes=3, seed=1)
    data = g.to_data()
    data.train_mask = torch.arange(120) % 2 == 0
    torch.manual_seed(0)
    net = MultimodalGNN({m: x.size(1) for m, x in g.features.items()}, 3, hidden=16)
    return data, net


def _fit(executor, data, net, epochs=4):
    module = NodeClassifier(copy.deepcopy(net), partial(torch.optim.Adam, lr=0.01))
    rec = Recorder()
    torch.manual_seed(123)
    executor.fit(module, data, epochs, [rec])
    return module, rec


def test_lean_and_trainer_paths_agree():
    data, net = _setup()
    lean, rec_l = _fit(LeanExecutor(), data, net)
    full, rec_t = _fit(TrainerExecutor(), data, net)
    for (k, a), (_, b) in zip(
        lean.net.state_dict().items(), full.net.state_dict().items(), strict=False
    ):
        assert torch.allclose(a, b, atol=1e-6), k
    assert rec_l.calls == rec_t.calls
    assert rec_l.calls == ["fit_start"] + ["after_backward", "before_step", "epoch_end"] * 4
    assert rec_l.grad_norms == rec_t.grad_norms or torch.allclose(
        torch.tensor(rec_l.grad_norms), torch.tensor(rec_t.grad_norms), atol=1e-6
    )


def test_on_after_backward_edits_reach_the_step():
    """A callback that zeroes a gradient in on_after_backward keeps that weight fixed."""

    class Freeze(pl.Callback):
        def on_after_backward(self, trainer, pl_module):
            pl_module.net.head.weight.grad.zero_()

    data, net = _setup()
    module = NodeClassifier(copy.deepcopy(net), partial(torch.optim.SGD, lr=0.5))
    before = module.net.head.weight.detach().clone()
    LeanExecutor().fit(module, data, 3, [Freeze()])
    assert torch.equal(module.net.head.weight, before)
    assert not torch.equal(module.net.head.bias, net.head.bias)


def test_proximal_term_hand_value():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    anchor = {"w": torch.tensor([0.0, 4.0])}
    # mu/2 * ((1-0)^2 + (2-4)^2) = 0.1/2 * 5 = 0.25
    assert proximal_term([("w", w)], anchor, 0.1).item() == 0.25


def _steps(factory, steps: int = 30) -> list[torch.Tensor]:
    """``steps`` updates of a few weights (a stack of five clients' word encoders among them)
    from seeded gradients, some entries' gradients zero (as under gradient projection)."""
    g = torch.Generator().manual_seed(1)
    shapes = [(5, 16, 300), (5, 16), (16, 33), (7, 16), (3,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    opt = factory(params)
    for _ in range(steps):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=g)
            if i % 2 == 0:
                p.grad[..., 0] = 0.0
        opt.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize(
    "factory",
    [
        partial(torch.optim.Adam, lr=0.01, weight_decay=5e-4),
        partial(torch.optim.Adam, lr=0.003, amsgrad=True),
        partial(torch.optim.AdamW, lr=0.01, weight_decay=0.01),
        partial(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True),
        partial(torch.optim.SGD, lr=0.1),
    ],
    ids=["adam", "adam-amsgrad", "adamw", "sgd-nesterov", "sgd"],
)
def test_foreach_updates_are_bitwise_the_per_tensor_ones(factory):
    fast = with_foreach(factory)
    assert fast.keywords["foreach"] is True
    per_tensor = _steps(partial(factory, foreach=False))
    multi = _steps(fast)
    assert all(torch.equal(a, b) for a, b in zip(per_tensor, multi, strict=True))
    assert not torch.equal(per_tensor[0], _steps(factory, steps=29)[0])  # the steps count


def test_foreach_is_left_to_an_explicit_setting_and_other_optimizers():
    for factory in (
        partial(torch.optim.Adam, lr=0.01, foreach=False),
        partial(torch.optim.Adam, lr=0.01, fused=True),
        partial(torch.optim.RMSprop, lr=0.01),
        torch.optim.Adam,
    ):
        assert with_foreach(factory) is factory
