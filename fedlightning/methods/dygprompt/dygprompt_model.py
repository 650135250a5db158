"""DyGPrompt's dual prompts and condition-nets (Yu et al., ICLR 2025, Sec. 4) on the frozen
bank's outputs: the state stands for the node feature, the event's time encoding for the time
feature, and Eq. (10)'s encoder pass is a sum (docs/temporal.md). Stacked like FedTIP's
adapter: ``copies`` parameter sets, inputs [K, N, d]."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from fedlightning.temporal.adapter import StackDropout, StackedCopies, StackedLinear

INITS = ("identity", "xavier")  # DyGPromptModule's starts (module docstring of dygprompt.py)
Batch = dict[str, Tensor]


def condition_net(copies: int, d_in: int, width: int, d_out: int, dropout: float) -> nn.Sequential:
    """A condition-net (TCN or NCN): ``d_in -> width`` (ReLU, dropout) ``-> d_out``."""
    return nn.Sequential(
        StackedLinear(copies, d_in, width), nn.ReLU(), StackDropout(dropout),
        StackedLinear(copies, width, d_out),
    )  # fmt: skip


def node_prompt(p_node: Tensor, h: Tensor) -> Tensor:
    """Eq. (4): ``p_node * h``."""
    return p_node.unsqueeze(1) * h


def time_prompt(p_time: Tensor, te: Tensor) -> Tensor:
    """Eq. (5): ``p_time * te``."""
    return p_time.unsqueeze(1) * te


def time_conditioned_node(tcn: nn.Module, f: Tensor, x: Tensor) -> Tensor:
    """Eqs. (6)-(7): ``TCN(f) * x``."""
    return tcn(f) * x


def node_conditioned_time(ncn: nn.Module, x: Tensor, f: Tensor) -> Tensor:
    """Eqs. (8)-(9): ``NCN(x) * f``."""
    return ncn(x) * f


def fuse(x_tv: Tensor, f_tv: Tensor) -> Tensor:
    """Eq. (10), the encoder's pass read as a sum."""
    return x_tv + f_tv


class DyGPromptModule(StackedCopies, nn.Module):
    """The two prompts, TCN and NCN: all that trains and travels. ``init``: ``identity``
    (starts at the frozen state) or ``xavier`` (the released code's)."""

    def __init__(
        self,
        d_h: int,
        d_t: int,
        bottleneck: int = 16,
        dropout: float = 0.0,
        copies: int = 1,
        init: str = "identity",
    ) -> None:
        super().__init__()
        if init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {init!r}")
        if d_t != d_h:
            raise ValueError(
                f"DyGPrompt adds the prompted time feature to the prompted state (Eq. 10): the "
                f"time encoding's width ({d_t}) must equal the state's ({d_h})"
            )
        if bottleneck < 1:
            raise ValueError(f"bottleneck must be at least 1, got {bottleneck}")
        self.d_h, self.copies = d_h, copies
        self.config = dict(d_h=d_h, d_t=d_t, bottleneck=bottleneck, dropout=dropout, init=init)
        self.p_node = nn.Parameter(torch.ones(copies, d_h))
        self.p_time = nn.Parameter(torch.zeros(copies, d_t))
        self.tcn = condition_net(copies, d_t, bottleneck, d_h, dropout)
        self.ncn = condition_net(copies, d_h, bottleneck, d_t, dropout)
        if init == "identity":
            for net in (self.tcn, self.ncn):
                nn.init.zeros_(net[-1].weight)
                nn.init.ones_(net[-1].bias)
        else:
            for p in (self.p_node, self.p_time):  # one [1, d] prompt per copy, as released
                bound = math.sqrt(6.0 / (1 + p.size(1)))
                nn.init.uniform_(p.data, -bound, bound)

    def prompted(self, h: Tensor, te: Tensor) -> Tensor:
        """Eqs. (4)-(10) of states ``h`` at their events' time encodings ``te``."""
        x = node_prompt(self.p_node, h)
        f = time_prompt(self.p_time, te)
        return fuse(time_conditioned_node(self.tcn, f, x), node_conditioned_time(self.ncn, x, f))

    def forward(
        self, h_u: Tensor, h_i: Tensor, te: Tensor, x: Tensor, delta_u: Tensor, delta_i: Tensor
    ) -> Tensor:
        """The prompted source in FedTIP's adapter call (2-D inputs: one copy)."""
        if h_u.dim() == 2:
            return self.prompted(h_u.unsqueeze(0), te.unsqueeze(0)).squeeze(0)
        return self.prompted(h_u, te)

    def views(self, batch: Batch, family: str) -> tuple[Tensor, ...]:
        """FedTIP's ``family_views`` tuple, every node prompted (Eq. 11's similarities)."""
        b, te = batch, batch["te"]
        h_u = self.prompted(b["h_u"], te)
        if family == "nc":
            return h_u, b["y"], b["mask"]
        h_i, h_j = self.prompted(b["h_i"], te), self.prompted(b["h_j"], te)
        return h_u, h_i, h_u, h_j, b["mask"] & b["neg_ok"]

    def groups(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """The prompts and the condition-nets' parameters (their own learning rates)."""
        return [self.p_node, self.p_time], [*self.tcn.parameters(), *self.ncn.parameters()]

    # ------------------------------------------------------------------ FedTIP's adapter verbs
    def num_values(self) -> int:
        return sum(p.numel() for p in self.parameters()) // self.copies

    def stacked(self, copies: int) -> DyGPromptModule:
        out = DyGPromptModule(**self.config, copies=copies)
        out.load_copies(self.state_dict())
        return out
