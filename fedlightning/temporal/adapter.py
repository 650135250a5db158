r"""FedTIP's interaction-conditioned prompt adapter and its task losses (paper 001, Sec. 4.2-4.3).

The adapter :math:`\Omega` of Eq. (17) is all that trains and travels: two parallel
bottleneck gates on the event context (Eqs. 13-15) and a low-rank task template (Eq. 16).
The losses are functions of the prompted representations: prototypical node
classification (Eqs. 18-19), two-way link prediction (Eqs. 20-21), and the proximal term of
Eq. (26) (the anchor term, Eq. (22), is :func:`fedlightning.objectives.anchor_loss`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def event_context(
    h_u: Tensor, h_i: Tensor, te: Tensor, x: Tensor, delta_u: Tensor, delta_i: Tensor
) -> Tensor:
    r"""Eq. (13): :math:`\mathbf{z} = [\mathbf{h}_u \| \mathbf{h}_i \| \mathrm{TE}(t) \|
    \mathbf{x} \| \Delta_u(t) \| \Delta_i(t)]`, one row per event (recencies ``[n]`` or
    ``[n, 1]``)."""
    return torch.cat(
        [h_u, h_i, te, x, delta_u.reshape(len(h_u), -1), delta_i.reshape(len(h_u), -1)], dim=-1
    )


class PromptAdapter(nn.Module):
    r"""Eqs. (14)-(17): the gates and the template, the only trainable part of FedTIP.

    .. math::
        \alpha^f = \sigma(W_f \varphi_f(\mathbf{z}) + b_f), \quad
        \alpha^t = \sigma(W_t \varphi_t(\mathbf{z}) + b_t), \quad
        \tilde{\mathbf{h}} = \psi(\alpha^f \odot [\mathbf{h}_u \| \mathbf{h}_i],\
        \alpha^t \odot \mathrm{TE}(t),\ \mathbf{x})

    :math:`\varphi_f, \varphi_t` are one-layer ReLU bottlenecks of width ``bottleneck``;
    :math:`\psi` is a low-rank linear template (``rank``) to :math:`d_p = d_h`, so that the
    cosine of Eq. (20) with a bank state is defined (methods.md). ``static=True`` gives the
    static-prompt ablation: gates that ignore the event (learned constants).

    Args:
        d_h: bank state width. d_t: time-encoding width. d_e: edge-feature width.
        bottleneck: gate bottleneck width (default ``2``). rank: template rank (default ``2``).
        static: the static-prompt ablation (default ``False``).
    """

    def __init__(
        self, d_h: int, d_t: int, d_e: int, bottleneck: int = 2, rank: int = 2, static: bool = False
    ) -> None:
        super().__init__()
        self.d_h, self.d_t, self.d_e, self.static = d_h, d_t, d_e, static
        d_z = 2 * d_h + d_t + d_e + 2
        self.phi_f = nn.Sequential(nn.Linear(d_z, bottleneck), nn.ReLU())
        self.phi_t = nn.Sequential(nn.Linear(d_z, bottleneck), nn.ReLU())
        self.gate_f = nn.Linear(bottleneck, 2 * d_h)  # W_f, b_f
        self.gate_t = nn.Linear(bottleneck, d_t)  # W_t, b_t
        self.psi = nn.Sequential(
            nn.Linear(2 * d_h + d_t + d_e, rank, bias=False), nn.Linear(rank, d_h)
        )

    def gates(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """Eqs. (14)-(15), computed in parallel from the same context."""
        if self.static:
            z = torch.zeros_like(z)
        return torch.sigmoid(self.gate_f(self.phi_f(z))), torch.sigmoid(self.gate_t(self.phi_t(z)))

    def forward(
        self, h_u: Tensor, h_i: Tensor, te: Tensor, x: Tensor, delta_u: Tensor, delta_i: Tensor
    ) -> Tensor:
        """The prompted representation :math:`\\tilde{\\mathbf{h}}` of Eq. (16), ``[n, d_h]``."""
        a_f, a_t = self.gates(event_context(h_u, h_i, te, x, delta_u, delta_i))
        return self.psi(torch.cat([a_f * torch.cat([h_u, h_i], -1), a_t * te, x], -1))

    def num_values(self) -> int:
        """Float32 values of :math:`\\Delta\\Omega` in a message."""
        return sum(p.numel() for p in self.parameters())


def message_values(adapter: PromptAdapter, classes: int) -> int:
    r"""Float32 values of one uplink message of Eq. (2): :math:`\Delta\Omega`, a prototype of
    width :math:`d_p` and a count per observed class, :math:`b_k` and the update norm."""
    return adapter.num_values() + classes * (adapter.d_h + 1) + 2


def class_prototypes(h: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """Eq. (18): the mean prompted representation of each class present; ``(classes, [C, d])``."""
    classes = y.unique(sorted=True)
    return classes, torch.stack([h[y == c].mean(0) for c in classes])


def prototypical_loss(h: Tensor, y: Tensor, tau: float = 0.1) -> Tensor:
    r"""Eq. (19): :math:`-\sum_{(e, y)} \log \mathrm{softmax}_c(s(\tilde{\mathbf{h}}_e,
    \mathbf{q}_c)/\tau)_y` over the client's local classes (a sum over its support)."""
    classes, q = class_prototypes(h, y)
    logits = F.cosine_similarity(h.unsqueeze(1), q.unsqueeze(0), dim=-1) / tau
    target = torch.searchsorted(classes, y)
    return F.cross_entropy(logits, target, reduction="sum")


def link_loss(h_pos: Tensor, h_i: Tensor, h_neg: Tensor, h_j: Tensor, tau: float = 0.1) -> Tensor:
    r"""Eqs. (20)-(21): :math:`-\sum \log \frac{e^{s(\tilde{\mathbf{h}}_{u,i}, \mathbf{h}_i)/\tau}}
    {e^{s(\tilde{\mathbf{h}}_{u,i}, \mathbf{h}_i)/\tau} + e^{s(\tilde{\mathbf{h}}_{u,j}, \mathbf{h}_j)/\tau}}`."""
    pos = F.cosine_similarity(h_pos, h_i, dim=-1) / tau
    neg = F.cosine_similarity(h_neg, h_j, dim=-1) / tau
    return -(pos - torch.logaddexp(pos, neg)).sum()


def proximal_adapter(adapter: nn.Module, anchor: dict[str, Tensor]) -> Tensor:
    r"""The proximal term of Eq. (26) without its weight: :math:`\lVert\Omega_k - \Omega^{(r)}\rVert_2^2`."""
    return sum(((p - anchor[n]) ** 2).sum() for n, p in adapter.named_parameters())
