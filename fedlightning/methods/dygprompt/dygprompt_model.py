r"""DyGPrompt's dual prompts and dual condition-nets (Yu et al., "Node-Time Conditional Prompt
Learning in Dynamic Graphs", ICLR 2025, Sec. 4), read on a frozen bank's outputs.

The paper prompts the encoder's *inputs* (node features :math:`\mathbf{x}_v`, time features
:math:`\mathbf{f}_t`) and runs the frozen encoder on them (its Eq. 10). Here the bank's states
and time encodings are precomputed once per protocol (docs/temporal.md), so the prompts act
on the frozen *outputs*: the node's state :math:`\mathbf{h}_v` stands for
:math:`\mathbf{x}_v`, the event's time encoding :math:`\mathrm{TE}(\Delta t)` for
:math:`\mathbf{f}_t` (one per event, shared by its source, destination and negative), and the
encoder of Eq. (10) is replaced by the sum :func:`fuse`. Per node :math:`v` at event time
:math:`t`:

.. math::
    \tilde{\mathbf{x}}_v = \mathbf{p}^{node} \odot \mathbf{h}_v \quad (4), \qquad
    \tilde{\mathbf{f}}_t = \mathbf{p}^{time} \odot \mathbf{f}_t \quad (5),

    \tilde{\mathbf{x}}_{t,v} = \mathrm{TCN}(\tilde{\mathbf{f}}_t) \odot \tilde{\mathbf{x}}_v
    \quad (6\text{-}7), \qquad
    \tilde{\mathbf{f}}_{t,v} = \mathrm{NCN}(\tilde{\mathbf{x}}_v) \odot \tilde{\mathbf{f}}_t
    \quad (8\text{-}9), \qquad
    \tilde{\mathbf{h}}_{t,v} = \tilde{\mathbf{x}}_{t,v} + \tilde{\mathbf{f}}_{t,v} \quad (10).

TCN (time condition-net: a time-conditioned node prompt) and NCN (node condition-net: a
node-conditioned time prompt) are two-layer bottleneck MLPs (ReLU), as the released code's
``meta_net`` (``d -> d/4 -> d``; ``bottleneck`` is the hidden width). Equation numbers: (9)-(11)
as the paper prints them; (4)-(8) by their order between the pre-training loss (3) and (9).

Stacked like FedTIP's adapter (:class:`~fedlightning.temporal.adapter.PromptAdapter`, whose
verbs this module shares): ``copies`` parameter sets on a leading axis, inputs ``[K, N, d]``.
"""

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
    r"""Eq. (4): :math:`\tilde{\mathbf{x}}_v = \mathbf{p}^{node} \odot \mathbf{h}_v`
    (``p_node`` ``[K, d_h]``, ``h`` ``[K, N, d_h]``)."""
    return p_node.unsqueeze(1) * h


def time_prompt(p_time: Tensor, te: Tensor) -> Tensor:
    r"""Eq. (5): :math:`\tilde{\mathbf{f}}_t = \mathbf{p}^{time} \odot \mathbf{f}_t`."""
    return p_time.unsqueeze(1) * te


def time_conditioned_node(tcn: nn.Module, f: Tensor, x: Tensor) -> Tensor:
    r"""Eqs. (6)-(7): the time-conditioned node prompt :math:`\mathrm{TCN}(\tilde{\mathbf{f}}_t)`
    applied to the prompted node feature, :math:`\tilde{\mathbf{x}}_{t,v}`."""
    return tcn(f) * x


def node_conditioned_time(ncn: nn.Module, x: Tensor, f: Tensor) -> Tensor:
    r"""Eqs. (8)-(9): the node-conditioned time prompt :math:`\mathrm{NCN}(\tilde{\mathbf{x}}_v)`
    applied to the prompted time feature, :math:`\tilde{\mathbf{f}}_{t,v}`."""
    return ncn(x) * f


def fuse(x_tv: Tensor, f_tv: Tensor) -> Tensor:
    r"""Eq. (10) with the frozen encoder's pass replaced by a sum (the bank has already
    encoded the node): :math:`\tilde{\mathbf{h}}_{t,v} = \tilde{\mathbf{x}}_{t,v} +
    \tilde{\mathbf{f}}_{t,v}`."""
    return x_tv + f_tv


class DyGPromptModule(StackedCopies, nn.Module):
    r"""The node prompt, the time prompt, TCN and NCN (module docstring): all that trains
    and travels.

    Args:
        d_h, d_t: the bank's state and time-encoding widths (equal: the sum of Eq. 10).
        bottleneck: the condition-nets' hidden width.
        dropout: a :class:`~fedlightning.temporal.adapter.StackDropout` on their hidden layer.
        copies: parameter sets (clients) stacked on a leading axis.
        init: ``identity`` (:math:`\mathbf{p}^{node} = 1`, :math:`\mathbf{p}^{time} = 0`,
            both condition-nets' output layers at weight 0 and bias 1: the prompted state
            starts at the frozen state, the bank's own similarity) or ``xavier`` (the released
            code's: Xavier-uniform prompts, PyTorch's default linear layers).
    """

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
        r""":math:`\tilde{\mathbf{h}}_{t,v}` (Eqs. 4-10) of states ``h`` ``[K, N, d_h]`` at
        their events' time encodings ``te`` ``[K, N, d_t]``."""
        x = node_prompt(self.p_node, h)
        f = time_prompt(self.p_time, te)
        return fuse(time_conditioned_node(self.tcn, f, x), node_conditioned_time(self.ncn, x, f))

    def forward(
        self, h_u: Tensor, h_i: Tensor, te: Tensor, x: Tensor, delta_u: Tensor, delta_i: Tensor
    ) -> Tensor:
        """The prompted source :math:`\\tilde{\\mathbf{h}}_{t,u}` in FedTIP's adapter call
        (``h_i``, the event features ``x`` and the recencies are not DyGPrompt's inputs):
        ``[K, N, d_h]`` (``[N, d_h]`` for 2-D inputs of a single copy)."""
        if h_u.dim() == 2:
            return self.prompted(h_u.unsqueeze(0), te.unsqueeze(0)).squeeze(0)
        return self.prompted(h_u, te)

    def views(self, batch: Batch, family: str) -> tuple[Tensor, ...]:
        """What the family's loss and the server's scorer read (FedTIP's ``family_views``
        order), every node prompted: ``nc`` the source's; ``lp`` the source's, the
        destination's and the negative's at the event's time (Eq. 11's similarities)."""
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
        """Float32 values of one copy (one client's delta)."""
        return sum(p.numel() for p in self.parameters()) // self.copies

    def stacked(self, copies: int) -> DyGPromptModule:
        """A module of ``copies`` stacked parameter sets (initialised from copy 0)."""
        out = DyGPromptModule(**self.config, copies=copies)
        out.load_copies(self.state_dict())
        return out
