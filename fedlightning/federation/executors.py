"""Executors run one client's local fit of a LightningModule: ``epochs`` full-batch steps,
``configure_optimizers`` called afresh (docs/architecture.md, "Execution"). On a ``device``
(``None``: where the module is) the fit runs on a shallow copy of the batch (never the
client's own data) and the module returns to the CPU; tensors a module keeps outside its
parameters move in its ``on_fit_start`` (e.g. a teacher, FedProx's anchor)."""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.utils.data import DataLoader

from fedlightning.clients.minibatch import MiniBatches, minibatches_for
from fedlightning.config import EXECUTOR_KEYS, GPU_ACCELERATORS, lean_refusal
from fedlightning.errors import ConfigError

for _name in (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.pytorch.accelerators.cuda",
    "lightning.fabric.utilities.seed",
):
    logging.getLogger(_name).setLevel(logging.WARNING)
# Lightning's own use of a deprecated torch pytree API; nothing a user can act on.
warnings.filterwarnings("ignore", message=".*LeafSpec.*")


#: Optimizers whose multi-tensor (``foreach``) update is bitwise their per-tensor one
#: (``tests/federation/test_executors.py``).
FOREACH_SAME = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def with_foreach(factory: Callable[..., torch.optim.Optimizer]) -> Callable[..., Any]:
    """``factory`` (``model.optimizer`` as Hydra builds it, a ``functools.partial`` of an
    optimizer class) with ``foreach=True`` when its class is in :data:`FOREACH_SAME` and it
    sets neither ``foreach`` nor ``fused``: on the CPU the same bits as torch's per-tensor
    default, faster (docs/scaling.md)."""
    if (
        isinstance(factory, partial)
        and factory.func in FOREACH_SAME
        and not {"foreach", "fused"} & factory.keywords.keys()
    ):
        return partial(factory, foreach=True)
    return factory


@dataclass
class LoopState:
    """What the lean loop passes as ``trainer`` to callbacks: the counters they may read."""

    max_epochs: int
    current_epoch: int = 0
    global_step: int = 0
    lightning_module: pl.LightningModule | None = None
    callbacks: Sequence[pl.Callback] = ()
    optimizers: Sequence[torch.optim.Optimizer] = ()


def _single_optimizer(conf: Any) -> torch.optim.Optimizer:
    if isinstance(conf, torch.optim.Optimizer):
        return conf
    if isinstance(conf, dict) and "optimizer" in conf and "lr_scheduler" not in conf:
        return conf["optimizer"]
    raise TypeError(
        "the lean executor supports configure_optimizers returning one optimizer "
        "(or {'optimizer': opt}); use runner.executor=trainer for anything else"
    )


def _with_module_callbacks(
    callbacks: Sequence[pl.Callback], module: pl.LightningModule
) -> list[pl.Callback]:
    """Lightning's rule for ``configure_callbacks`` (``_attach_model_callbacks``): for each
    class of the module's callbacks, the first given class it derives from is dropped from
    the given callbacks, and the module's callbacks come after the rest."""
    extra = module.configure_callbacks()
    if not extra:
        return list(callbacks)
    extra = list(extra) if isinstance(extra, Sequence) else [extra]
    given = {type(c) for c in callbacks}
    given.discard(pl.Callback)
    override = set()
    for model_type in {type(c) for c in extra}:
        for given_type in given:
            if issubclass(model_type, given_type):
                override.add(given_type)
                break
    return [c for c in callbacks if type(c) not in override] + extra


class LeanExecutor:
    """Run ``epochs`` full-batch steps with Lightning's hooks, in Lightning's order (the
    callbacks' first, then the module's), without a Trainer (docs/architecture.md lists the
    hooks and what has no counterpart: the batch moves to ``device`` once per fit;
    ``transfer_batch_to_device`` and ``configure_gradient_clipping`` run only where the
    module overrides them, the latter without ``self.clip_gradients``; ``training_step``
    returns the loss; no logger, checkpoint or validation hooks).

    Args:
        device: where the fit runs (default ``None``: where the module is, or the CUDA GPU
            that ``trainer``'s ``accelerator`` asks for).
        trainer: the ``trainer`` group's settings (conf/trainer); it honours cpu, auto or one
            GPU, 32-bit precision, ``deterministic`` and gradient clipping, and refuses any
            other in one line (:func:`fedlightning.config.lean_refusal`)."""

    name = "lean"

    def __init__(
        self, device: str | torch.device | None = None, trainer: Mapping[str, Any] | None = None
    ) -> None:
        settings = dict(trainer or {})
        if refused := lean_refusal(settings):
            raise ConfigError(f"trainer.{refused[0]}", refused[1])
        accelerator = settings.get("accelerator", "cpu")
        if device is None and (
            accelerator in GPU_ACCELERATORS or (accelerator == "auto" and torch.cuda.is_available())
        ):
            device = "cuda"
        self.device = None if device is None else torch.device(device)
        self.clip_val = settings.get("gradient_clip_val")
        self.clip_algorithm = settings.get("gradient_clip_algorithm") or "norm"
        if settings.get("deterministic"):  # what Lightning's Trainer(deterministic=...) sets
            torch.use_deterministic_algorithms(True, warn_only=settings["deterministic"] == "warn")

    def fit(
        self,
        module: pl.LightningModule,
        batch: Any,
        epochs: int,
        callbacks: Sequence[pl.Callback] = (),
    ) -> None:
        callbacks = _with_module_callbacks(callbacks, module)
        state = LoopState(max_epochs=epochs, lightning_module=module, callbacks=callbacks)
        batch = minibatches_for(module, batch)  # a graph beyond federation.minibatch's budget
        if self.device is not None:
            module.to(self.device)
        try:
            if self.device is not None and not isinstance(batch, MiniBatches):  # moves in place
                batch = move_data_to_device(copy.copy(batch), self.device)
            self._run(module, batch, epochs, callbacks, state)
        except BaseException as e:
            for cb in callbacks:
                cb.on_exception(state, module, e)
            raise
        finally:
            if self.device is not None:
                module.cpu()

    def _run(
        self,
        module: pl.LightningModule,
        batch: Any,
        epochs: int,
        callbacks: Sequence[pl.Callback],
        state: LoopState,
    ) -> None:
        hook = partial(self._hook, module=module, callbacks=callbacks, state=state)
        module.prepare_data()
        hook("setup", stage="fit")
        module.configure_model()
        opt = _single_optimizer(module.configure_optimizers())
        state.optimizers = [opt]
        clip = self._clipper(module)
        transfer = is_overridden("transfer_batch_to_device", module)
        device = self.device if self.device is not None else module.device
        module.train()
        hook("on_fit_start")
        hook("on_train_start")
        for epoch in range(epochs):
            state.current_epoch = epoch
            hook("on_train_epoch_start")
            for i, raw in enumerate(batch if isinstance(batch, MiniBatches) else [batch]):
                if isinstance(batch, MiniBatches) and self.device is not None:
                    raw = move_data_to_device(raw, self.device)
                b = module.on_before_batch_transfer(copy.copy(raw), i)
                if transfer:  # the default's move would find the batch on the device already
                    b = module.transfer_batch_to_device(b, device, i)
                b = module.on_after_batch_transfer(b, i)
                if hook("on_train_batch_start", b, i) != -1:  # -1: Lightning skips the step
                    outputs = self._step(module, b, epoch, opt, hook, clip, i)
                    state.global_step += 1
                    hook("on_train_batch_end", outputs, b, i)
            hook("on_train_epoch_end")
        state.current_epoch = epochs
        hook("on_train_end")
        hook("on_fit_end")
        hook("teardown", stage="fit")

    def _clipper(self, module: pl.LightningModule) -> Callable[[Any], None] | None:
        """What clips a step's gradients: the module's ``configure_gradient_clipping`` where it
        overrides it, else :func:`clip_gradients` with ``gradient_clip_val`` (``None``: none)."""
        if is_overridden("configure_gradient_clipping", module):
            val, algorithm = self.clip_val, (self.clip_algorithm if self.clip_val else None)
            return lambda opt: module.configure_gradient_clipping(opt, val, algorithm)
        if self.clip_val:
            return lambda opt: clip_gradients(opt, self.clip_val, self.clip_algorithm)
        return None

    @staticmethod
    def _step(
        module: pl.LightningModule,
        batch: Any,
        epoch: int,
        opt: torch.optim.Optimizer,
        hook: Callable[..., Any],
        clip: Callable[[Any], None] | None,
        batch_idx: int = 0,
    ) -> dict[str, Any]:
        """``optimizer_step`` with Lightning's closure; the outputs ``on_train_batch_end``
        gets (the detached loss and the step's other keys)."""
        outputs: dict[str, Any] = {}

        def closure() -> Tensor:
            out = module.training_step(batch, batch_idx)
            loss = out.get("loss") if isinstance(out, Mapping) else out
            if not isinstance(loss, Tensor):
                raise TypeError(
                    "the lean executor needs training_step to return the loss (or "
                    "{'loss': ...}); use runner.executor=trainer to skip steps"
                )
            hook("on_before_zero_grad", opt)
            module.optimizer_zero_grad(epoch, batch_idx, opt)
            hook("on_before_backward", loss)
            module.backward(loss)
            hook("on_after_backward")
            hook("on_before_optimizer_step", opt)
            if clip is not None:
                clip(opt)
            outputs["loss"] = loss.detach().clone()  # what Lightning passes on
            if isinstance(out, Mapping):
                outputs.update((k, v) for k, v in out.items() if k != "loss")
            return loss

        module.optimizer_step(epoch, batch_idx, opt, closure)
        return outputs

    @staticmethod
    def _hook(
        name: str,
        *args: Any,
        module: pl.LightningModule,
        callbacks: Sequence[pl.Callback],
        state: LoopState,
        **kw: Any,
    ) -> Any:
        """The callbacks' hook ``name`` (with ``state`` as the trainer), then the module's,
        as Lightning calls them; the module's answer."""
        for cb in callbacks:
            getattr(cb, name)(state, module, *args, **kw)
        return getattr(module, name)(*args, **kw)


def clip_gradients(opt: torch.optim.Optimizer, value: float, algorithm: str = "norm") -> None:
    """Clip the gradients of ``opt``'s parameters as ``Trainer(gradient_clip_val=value,
    gradient_clip_algorithm=algorithm)`` does at 32-bit precision: their total L2 norm to at
    most ``value`` (``norm``), or each element to ``[-value, value]`` (``value``)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    if algorithm == "value":
        torch.nn.utils.clip_grad_value_(params, value)
    else:
        torch.nn.utils.clip_grad_norm_(params, value)


def _copy_first(items: list[Any]) -> Any:
    return copy.copy(items[0])  # Lightning moves a PyG Data in place: move a copy


class TrainerExecutor:
    """Run the local fit with a fresh ``lightning.Trainer`` (one full-batch step per epoch).

    Args:
        accelerator, devices, precision, strategy: the Trainer's (defaults ``"cpu"``, ``1``,
            ``"32-true"``, ``"auto"``; ``"ddp"`` with ``devices > 1`` spreads one client's
            fit over several GPUs, docs/scaling.md).
        device: one device for the fit (default ``None``: ``accelerator`` and ``devices``
            decide); a CUDA device overrides them with that one GPU (set by
            ``runner=distributed``).
        trainer: the ``trainer`` group (conf/trainer): every other ``lightning.Trainer``
            argument (``deterministic``, ``gradient_clip_val``, ...); the four above win."""

    name = "trainer"

    def __init__(
        self,
        accelerator: str = "cpu",
        devices: int | str | list[int] = 1,
        precision: str = "32-true",
        strategy: str = "auto",
        device: str | torch.device | None = None,
        trainer: Mapping[str, Any] | None = None,
    ) -> None:
        self.accelerator, self.devices, self.precision = accelerator, devices, precision
        self.strategy = strategy
        self.settings = {k: v for k, v in (trainer or {}).items() if k not in EXECUTOR_KEYS}
        self.device = None if device is None else torch.device(device)

    def fit(
        self,
        module: pl.LightningModule,
        batch: Any,
        epochs: int,
        callbacks: Sequence[pl.Callback] = (),
    ) -> None:
        accelerator, devices = self.accelerator, self.devices
        if self.device is not None and self.device.type == "cuda":
            accelerator, devices = "gpu", [self.device.index or 0]
        trainer = pl.Trainer(
            max_epochs=epochs,
            accelerator=accelerator,
            devices=devices,
            strategy=self.strategy,
            precision=self.precision,
            **self.settings,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=list(callbacks),
            limit_val_batches=0,
        )
        # A private generator keeps the DataLoader from drawing on the global RNG, so both
        # executors consume the same random numbers (dropout) and give the same weights.
        batch = minibatches_for(module, batch)  # a graph beyond federation.minibatch's budget
        if isinstance(batch, MiniBatches):
            trainer.fit(module, train_dataloaders=batch)
            return
        loader = DataLoader([batch], collate_fn=_copy_first, generator=torch.Generator())
        trainer.fit(module, train_dataloaders=loader)
