"""Executors run one client's local fit of a LightningModule: ``epochs`` full-batch steps,
``configure_optimizers`` called afresh (docs/architecture.md, "Execution"). On a ``device``
(``None``: where the module is) the fit runs on a shallow copy of the batch (never the
client's own data) and the module returns to the CPU; tensors a module keeps outside its
parameters move in its ``on_fit_start`` (e.g. a teacher, FedProx's anchor).
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch.utils.data import DataLoader

for _name in (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.pytorch.accelerators.cuda",
    "lightning.fabric.utilities.seed",
):
    logging.getLogger(_name).setLevel(logging.WARNING)
# Lightning's own use of a deprecated torch pytree API; nothing a user can act on.
warnings.filterwarnings("ignore", message=".*LeafSpec.*")


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


class LeanExecutor:
    """Run ``epochs`` full-batch steps with Lightning's hook order, without a Trainer.

    Args:
        device: where the fit runs (default ``None``: where the module is).
    """

    name = "lean"

    def __init__(self, device: str | torch.device | None = None) -> None:
        self.device = None if device is None else torch.device(device)

    def fit(
        self,
        module: pl.LightningModule,
        batch: Any,
        epochs: int,
        callbacks: Sequence[pl.Callback] = (),
    ) -> None:
        if self.device is not None:
            module.to(self.device)
        try:
            if self.device is not None:  # a PyG Data moves in place: move a shallow copy
                batch = move_data_to_device(copy.copy(batch), self.device)
            state = LoopState(max_epochs=epochs, lightning_module=module, callbacks=callbacks)
            opt = _single_optimizer(module.configure_optimizers())
            state.optimizers = [opt]
            module.train()
            self._hook("on_fit_start", module, callbacks, state)
            self._hook("on_train_start", module, callbacks, state)
            for epoch in range(epochs):
                state.current_epoch = epoch
                self._hook("on_train_epoch_start", module, callbacks, state)
                out = module.training_step(batch, 0)
                loss = out["loss"] if isinstance(out, dict) else out
                module.optimizer_zero_grad(epoch, 0, opt)
                self._hook("on_before_backward", module, callbacks, state, loss)
                module.backward(loss)
                self._hook("on_after_backward", module, callbacks, state)
                self._hook("on_before_optimizer_step", module, callbacks, state, opt)
                opt.step()
                state.global_step += 1
                self._hook("on_train_batch_end", module, callbacks, state, out, batch, 0)
                self._hook("on_train_epoch_end", module, callbacks, state)
            state.current_epoch = epochs
            self._hook("on_train_end", module, callbacks, state)
            self._hook("on_fit_end", module, callbacks, state)
        finally:
            if self.device is not None:
                module.cpu()

    @staticmethod
    def _hook(
        name: str,
        module: pl.LightningModule,
        callbacks: Sequence[pl.Callback],
        state: LoopState,
        *args: Any,
    ) -> None:
        # Lightning calls callbacks first in on_*_start and the module first in the step
        # hooks; our callbacks do not depend on it: the module goes first throughout.
        getattr(module, name)(*args)
        for cb in callbacks:
            getattr(cb, name)(state, module, *args)


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
    """

    name = "trainer"

    def __init__(
        self,
        accelerator: str = "cpu",
        devices: int | str | list[int] = 1,
        precision: str = "32-true",
        strategy: str = "auto",
        device: str | torch.device | None = None,
    ) -> None:
        self.accelerator, self.devices, self.precision = accelerator, devices, precision
        self.strategy = strategy
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
        loader = DataLoader([batch], collate_fn=_copy_first, generator=torch.Generator())
        trainer.fit(module, train_dataloaders=loader)
