r"""Gradient shielding of protected structural weights, FedOGL Eq. (9), as a callback."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from fedlightning.methods.fedogl.basis import project_out


class GradientProjection(pl.Callback):
    """Eq. (9) on each protected weight's gradient (``bases``: parameter name -> [in, r]);
    with ``project_update`` each step's change is projected too (Adam and weight decay move
    inside the span) and ``frozen_biases`` are reverted. A stacked [K, out, in] weight is
    projected copy by copy."""

    def __init__(
        self,
        bases: Mapping[str, Tensor] | None = None,
        project_update: bool = True,
        frozen_biases: Iterable[str] | None = None,
    ) -> None:
        super().__init__()
        self.project_update = bool(project_update)
        self.frozen_biases: list[str] = list(frozen_biases or [])
        self.bases: dict[str, Tensor] = {}
        self._cast: dict[str, Tensor] = {}  # the bases on their weights' device and dtype
        self._snapshot: dict[str, Tensor] = {}
        self.set_bases(bases or {})

    def set_bases(self, bases: Mapping[str, Tensor]) -> None:
        """Replace the protected weights and their bases (e.g. at a stage start)."""
        checked: dict[str, Tensor] = {}
        for name, u in bases.items():
            if u.dim() != 2 or not u.is_floating_point():
                raise ValueError(
                    f"basis of {name!r} must be a float [in, r] tensor, got {tuple(u.shape)} "
                    f"{u.dtype}"
                )
            gram = u.detach().double().T @ u.detach().double()
            if not torch.allclose(gram, torch.eye(u.size(1), dtype=gram.dtype), atol=1e-4):
                raise ValueError(f"basis of {name!r} must have orthonormal columns")
            checked[name] = u.detach().clone()
        self.bases = checked
        self._cast.clear()
        self._snapshot.clear()

    def _params(self, pl_module: nn.Module) -> dict[str, nn.Parameter]:
        params = dict(pl_module.named_parameters())
        missing = [n for n in [*self.bases, *self.frozen_biases] if n not in params]
        if missing:
            raise KeyError(
                f"GradientProjection: no parameter named {missing} in "
                f"{type(pl_module).__name__}; it has e.g. {list(params)[:8]}"
            )
        for name, u in self.bases.items():
            p = params[name]
            if p.dim() not in (2, 3) or p.size(-1) != u.size(0):
                raise ValueError(
                    f"GradientProjection: basis of {name!r} is {tuple(u.shape)} but the "
                    f"weight is {tuple(p.shape)}; expected [in={p.size(-1)}, r]"
                )
        return params

    def _project(self, name: str, g: Tensor) -> Tensor:
        """Eq. (9) on ``g`` ``[out, in]``, or on each copy of a stacked ``[K, out, in]``."""
        u = self._cast[name]
        if g.dim() == 3:
            return torch.stack([project_out(gk, u) for gk in g.unbind(0)])
        return project_out(g, u)

    def on_fit_start(self, trainer: Any, pl_module: pl.LightningModule) -> None:
        self._snapshot.clear()
        params = self._params(pl_module)  # fail before training on a wrong name or shape
        self._cast = {
            n: u.to(device=params[n].device, dtype=params[n].dtype) for n, u in self.bases.items()
        }

    @torch.no_grad()
    def on_after_backward(self, trainer: Any, pl_module: pl.LightningModule) -> None:
        params = self._params(pl_module)
        for name in self.bases:
            p = params[name]
            if p.grad is not None and self.bases[name].size(1) > 0:
                p.grad.copy_(self._project(name, p.grad))
        for name in self.frozen_biases:
            if params[name].grad is not None:
                params[name].grad.zero_()

    @torch.no_grad()
    def on_before_optimizer_step(
        self, trainer: Any, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self.project_update:
            return
        params = self._params(pl_module)
        for name in [*self.bases, *self.frozen_biases]:
            if name not in self._snapshot:
                self._snapshot[name] = params[name].detach().clone()

    @torch.no_grad()
    def on_train_batch_end(
        self,
        trainer: Any,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self._snapshot:
            return
        params = self._params(pl_module)
        for name, before in self._snapshot.items():
            p = params[name]
            if name in self.frozen_biases:
                p.copy_(before)
            elif self.bases[name].size(1) > 0:
                p.copy_(before + self._project(name, p - before))
        self._snapshot.clear()
