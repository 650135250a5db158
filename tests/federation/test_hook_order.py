"""The lean executor calls the hooks Lightning's fit loop calls, in the same order: a module
and a callback that record every hook they have run under both executors, and the two
records are compared (as are the weights)."""

from __future__ import annotations

import copy
import inspect
from functools import partial

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.core.hooks import CheckpointHooks, DataHooks, ModelHooks

from fedlightning.clients import NodeClassifier
from fedlightning.data.graphs import make_synthetic
from fedlightning.federation.executors import LeanExecutor, TrainerExecutor
from fedlightning.models import MultimodalGNN

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CALLBACK_HOOKS = sorted(
    n
    for n, _ in inspect.getmembers(pl.Callback, inspect.isfunction)
    if not n.startswith("_") and n not in ("state_dict", "load_state_dict")
)
# every public hook of the module; dataloader hooks are left out (the batch is given to
# the fit: Lightning calls none of them), as is the deprecated configure_sharded_model
MODULE_HOOKS = sorted(
    {
        n
        for c in (ModelHooks, DataHooks, CheckpointHooks)
        for n, _ in inspect.getmembers(c, inspect.isfunction)
        if not n.startswith("_") and not n.endswith("_dataloader")
    }
    - {"configure_sharded_model"}
    | {
        "training_step",
        "configure_optimizers",
        "optimizer_step",
        "optimizer_zero_grad",
        "backward",
        "configure_gradient_clipping",
        "lr_scheduler_step",
        "configure_callbacks",
        "toggle_optimizer",
        "untoggle_optimizer",
    }
)


def recording(cls: type, names: list[str], prefix: str) -> type:
    """A subclass of ``cls`` whose every hook of ``names`` appends ``prefix.name`` (or
    ``tag.name`` for an instance with a ``tag``) to ``self.calls``, then runs the parent's."""

    def wrap(name: str):
        parent = getattr(cls, name)

        def hook(self, *args, **kw):
            self.calls.append(f"{getattr(self, 'tag', prefix)}.{name}")
            if name == "configure_gradient_clipping":
                return None  # without a clip value the parent's clips nothing (and reads
                # the Trainer, which a lean fit has not)
            return parent(self, *args, **kw)

        return hook

    return type(f"Recording{cls.__name__}", (cls,), {n: wrap(n) for n in names})


RecordingModule = recording(NodeClassifier, MODULE_HOOKS, "module")
RecordingCallback = recording(pl.Callback, CALLBACK_HOOKS, "callback")


class SkipOddEpochs(RecordingModule):
    """Answers -1 from on_train_batch_start in odd epochs: Lightning skips that step."""

    def on_train_batch_start(self, batch, batch_idx):
        super().on_train_batch_start(batch, batch_idx)
        return -1 if self.current_epoch_seen % 2 else None

    def on_train_epoch_start(self):
        super().on_train_epoch_start()
        self.current_epoch_seen = getattr(self, "current_epoch_seen", -1) + 1


def graph():
    g = make_synthetic(num_nodes=90, num_classes=3, seed=1)
    data = g.to_data()
    data.train_mask = torch.arange(90) % 2 == 0
    torch.manual_seed(0)
    net = MultimodalGNN({m: x.size(1) for m, x in g.features.items()}, 3, hidden=8)
    return data, net


def fit(executor, cls=RecordingModule, epochs=3, extra=()):
    """One fit; the shared record of hooks (module and callback together) and the module."""
    data, net = graph()
    module = cls(copy.deepcopy(net), partial(torch.optim.Adam, lr=0.01))
    calls: list[str] = []
    module.calls = calls
    callback = RecordingCallback()
    callback.calls = calls
    for cb in extra:
        cb.calls = calls
    torch.manual_seed(7)
    executor.fit(module, data, epochs, [callback, *extra])
    return calls, module


def test_hook_order_of_the_lean_loop_is_lightnings():
    lightning_calls, full = fit(TrainerExecutor())
    lean_calls, lean = fit(LeanExecutor())
    # independently of both executors: the step hooks named in Lightning's documented order
    step = [
        "callback.on_train_batch_start",
        "module.on_train_batch_start",
        "module.optimizer_step",
        "module.training_step",
        "callback.on_before_zero_grad",
        "module.on_before_zero_grad",
        "module.optimizer_zero_grad",
        "callback.on_before_backward",
        "module.on_before_backward",
        "module.backward",
        "callback.on_after_backward",
        "module.on_after_backward",
        "callback.on_before_optimizer_step",
        "module.on_before_optimizer_step",
        "module.configure_gradient_clipping",
        "callback.on_train_batch_end",
        "module.on_train_batch_end",
    ]
    i = lightning_calls.index(step[0])
    assert lightning_calls[i : i + len(step)] == step
    assert lightning_calls.count("module.training_step") == 3
    assert lean_calls == lightning_calls
    for (k, a), (_, b) in zip(
        lean.net.state_dict().items(), full.net.state_dict().items(), strict=True
    ):
        assert torch.allclose(a, b, atol=1e-6), k


Replaced = recording(pl.Callback, CALLBACK_HOOKS, "replaced")


def test_a_skipped_step_and_module_callbacks_follow_lightning():
    class Replacement(Replaced):
        pass

    class WithCallbacks(SkipOddEpochs):
        def configure_callbacks(self):
            super().configure_callbacks()
            mine = Replacement()
            mine.calls, mine.tag = self.calls, "module's"
            return [mine]  # replaces the given Replaced (its parent class), after the rest

    records, weights = [], []
    for executor in (TrainerExecutor(), LeanExecutor()):
        given = Replaced()
        given.tag = "given"
        calls, module = fit(executor, WithCallbacks, 4, [given])
        records.append(calls)
        weights.append(module.net.state_dict())
    lightning_calls, lean_calls = records
    assert lean_calls == lightning_calls
    assert lightning_calls.count("module.training_step") == 2  # epochs 1 and 3 skipped
    assert lightning_calls.count("module.on_train_batch_start") == 4
    assert lightning_calls.count("module.on_train_epoch_end") == 4
    assert not any(c.startswith("given.") for c in lightning_calls)
    i = lightning_calls.index("callback.on_fit_start")
    assert lightning_calls[i : i + 3] == [
        "callback.on_fit_start",
        "module's.on_fit_start",
        "module.on_fit_start",
    ]
    for k, a in weights[1].items():
        assert torch.allclose(a, weights[0][k], atol=1e-6), k


def test_an_error_reaches_the_callbacks_on_exception():
    class Boom(RecordingModule):
        def on_after_backward(self):
            super().on_after_backward()
            raise RuntimeError("boom")

    records = []
    for executor in (TrainerExecutor(), LeanExecutor()):
        data, net = graph()
        module = Boom(copy.deepcopy(net), partial(torch.optim.Adam, lr=0.01))
        module.calls = []
        callback = RecordingCallback()
        callback.calls = module.calls
        with pytest.raises(RuntimeError, match="boom"):
            executor.fit(module, data, 2, [callback])
        records.append(module.calls)
    assert records[0] == records[1]
    assert records[0][-2:] == ["module.on_after_backward", "callback.on_exception"]
