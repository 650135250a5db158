r"""FedTIP's interaction-conditioned prompt adapter and its task losses (paper 001, Sec. 4.2-4.3).

The adapter :math:`\Omega` of Eq. (17) is all that trains and travels: two parallel
bottleneck gates on the event context (Eqs. 13-15) and a low-rank task template (Eq. 16).
The losses: prototypical node classification (Eqs. 18-19), two-way link prediction
(Eqs. 20-21), the anchor term (Eq. 22) and the proximal term of Eq. (26).

Everything is *stacked*: ``copies`` parameter sets (one per client of a round), inputs
``[K, N, ...]`` with a mask ``[K, N]``, losses summed over clients (docs/fedtip.md, "Fast
path"); ``copies=1`` takes 2-D inputs too."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

TIES = ("none", "phi")  # PromptAdapter's readings of Eq. (17): two bottlenecks, or one shared
# PromptAdapter's readings of psi in Eq. (16): the paper's three-input map alone, or that map
# added to the gated source state (the pre-training similarity; a deviation, docs/readings.md)
TEMPLATES = ("residual", "paper")


def event_context(
    h_u: Tensor, h_i: Tensor, te: Tensor, x: Tensor, delta_u: Tensor, delta_i: Tensor
) -> Tensor:
    r"""Eq. (13): :math:`\mathbf{z} = [\mathbf{h}_u \| \mathbf{h}_i \| \mathrm{TE}(t) \|
    \mathbf{x} \| \Delta_u(t) \| \Delta_i(t)]`, one row per event (recencies without the
    feature axis)."""
    return torch.cat([h_u, h_i, te, x, delta_u.unsqueeze(-1), delta_i.unsqueeze(-1)], dim=-1)


class StackedLinear(nn.Module):
    """``copies`` independent linear maps applied to ``[copies, N, d_in]`` (each one
    initialised as :class:`torch.nn.Linear`; one copy also takes ``[N, d_in]``)."""

    def __init__(self, copies: int, d_in: int, d_out: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(copies, d_out, d_in))
        self.bias = nn.Parameter(torch.empty(copies, d_out)) if bias else None
        bound = 1 / math.sqrt(d_in) if d_in else 0.0
        for k in range(copies):
            nn.init.kaiming_uniform_(self.weight.data[k], a=math.sqrt(5))
            if self.bias is not None:
                nn.init.uniform_(self.bias.data[k], -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2:  # a single copy's [N, d_in]
            return self.forward(x.unsqueeze(0)).squeeze(0)
        out = torch.bmm(x, self.weight.transpose(1, 2))
        return out if self.bias is None else out + self.bias.unsqueeze(1)


class StackDropout(nn.Module):
    """Dropout on ``[K, N, d]`` whose mask is drawn for a round of ``total`` stacked copies,
    of which this stack holds copies ``first .. first + K - 1`` (:attr:`window`), so a
    copy's mask does not depend on how the round is split into stacks. With ``window=None``
    it is :func:`torch.nn.functional.dropout` on CPU. ``p`` lies in ``[0, 1)``."""

    def __init__(self, p: float) -> None:
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"dropout must lie in [0, 1), got {p}")
        self.p = p
        self.window: tuple[int, int] | None = None  # (first, total); None: the whole round

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        first, total = self.window or (0, x.size(0))
        noise = x.new_empty((total, *x.shape[1:])).bernoulli_(1 - self.p)
        return x * noise[first : first + x.size(0)].div_(1 - self.p)


class StackedCopies:
    """The verbs of a task's trainable module that holds ``copies`` stacked parameter sets
    (every parameter ``[copies, ...]``): its place in a round, and its copies set from or
    read as single-copy states. :class:`PromptAdapter` and the DyGPrompt module share them."""

    copies: int

    def place(self, first: int, total: int) -> None:
        """These copies are ``first .. first + copies - 1`` of a round of ``total``: dropout
        draws the whole round's masks and keeps theirs (:class:`StackDropout`)."""
        if not 0 <= first <= total - self.copies:
            raise ValueError(f"copies {first}..{first + self.copies - 1} are not among {total}")
        for m in self.modules():
            if isinstance(m, StackDropout):
                m.window = (first, total)

    def load_copies(self, state: dict[str, Tensor]) -> None:
        """Set every copy to the single-copy ``state`` (the server's global parameters)."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(state[name][:1].expand_as(p))

    def copy_state(self, k: int) -> dict[str, Tensor]:
        """Copy ``k`` as a single-copy state dict."""
        return {n: p.detach()[k : k + 1].clone() for n, p in self.named_parameters()}


class PromptAdapter(StackedCopies, nn.Module):
    r"""Eqs. (14)-(17): the gates and the template, the only trainable part of FedTIP.

    .. math::
        \alpha^f = \sigma(W_f \varphi_f(\mathbf{z}) + b_f), \quad
        \alpha^t = \sigma(W_t \varphi_t(\mathbf{z}) + b_t), \quad
        \tilde{\mathbf{h}} = \psi(\alpha^f \odot [\mathbf{h}_u \| \mathbf{h}_i],\
        \alpha^t \odot \mathrm{TE}(t),\ \mathbf{x})

    :math:`\varphi_f, \varphi_t` are one-layer ReLU bottlenecks of width ``bottleneck``.
    :math:`\psi` (``template``, :data:`TEMPLATES`) maps the concatenation of its three inputs
    (:math:`2 d_h + d_t + d_e` wide) to :math:`d_p = d_h` by a rank-``rank`` linear map
    :math:`B A \cdot + \mathbf{b}` (why linear and low-rank: docs/fedtip.md).
    ``template="paper"`` is Eq. (16) as written; ``template="residual"`` (the default, a
    deviation, docs/readings.md) adds the gated source state :math:`\alpha^f_u \odot
    \mathbf{h}_u`, the map's output factor starting at zero, so training starts from the
    pre-training similarity of Eq. (10). ``static=True`` is the static-prompt ablation (gates
    that ignore the event). ``d_h``, ``d_t``, ``d_e``: bank state, time-encoding and
    edge-feature widths; ``dropout``: a :class:`StackDropout` on the bottleneck activations;
    ``copies``: parameter sets (clients) stacked on a leading axis. ``tie`` (:data:`TIES`):
    ``"none"``, two bottlenecks, or ``"phi"``, one shared :math:`\varphi` (and one dropout
    draw) feeding both gates, which keep their own :math:`W, \mathbf{b}` (docs/fedtip.md)."""

    def __init__(
        self,
        d_h: int,
        d_t: int,
        d_e: int,
        bottleneck: int = 2,
        rank: int = 2,
        static: bool = False,
        dropout: float = 0.0,
        copies: int = 1,
        template: str = "residual",
        tie: str = "none",
    ) -> None:
        super().__init__()
        if tie not in TIES:
            raise ValueError(f"tie must be one of {TIES}, got {tie!r}")
        if template not in TEMPLATES:
            raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
        self.d_h, self.static, self.copies = d_h, static, copies
        self.residual, self.tie = template == "residual", tie
        self.config = dict(d_h=d_h, d_t=d_t, d_e=d_e, bottleneck=bottleneck, rank=rank)
        self.config.update(static=static, dropout=dropout, template=template, tie=tie)
        d_z, k = 2 * d_h + d_t + d_e + 2, copies

        def phi() -> nn.Sequential:
            return nn.Sequential(
                StackedLinear(k, d_z, bottleneck), nn.ReLU(), StackDropout(dropout)
            )

        self.phi_f = phi()
        self.phi_t = phi() if tie == "none" else None  # "phi": phi_t is phi_f
        self.gate_f = StackedLinear(k, bottleneck, 2 * d_h)  # W_f, b_f
        self.gate_t = StackedLinear(k, bottleneck, d_t)  # W_t, b_t
        self.psi = nn.Sequential(
            StackedLinear(k, 2 * d_h + d_t + d_e, rank, bias=False), StackedLinear(k, rank, d_h)
        )
        if self.residual:  # start from the pre-training template (LoRA's zero-initialised B)
            nn.init.zeros_(self.psi[1].weight)
            nn.init.zeros_(self.psi[1].bias)

    def gates(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """Eqs. (14)-(15), computed in parallel from the same context ``[K, N, d_z]``."""
        if self.static:
            z = torch.zeros_like(z)
        if self.phi_t is None:  # tie="phi": one bottleneck feeds both gates
            hidden = self.phi_f(z)
            return torch.sigmoid(self.gate_f(hidden)), torch.sigmoid(self.gate_t(hidden))
        return torch.sigmoid(self.gate_f(self.phi_f(z))), torch.sigmoid(self.gate_t(self.phi_t(z)))

    def forward(
        self, h_u: Tensor, h_i: Tensor, te: Tensor, x: Tensor, delta_u: Tensor, delta_i: Tensor
    ) -> Tensor:
        """The prompted representation :math:`\\tilde{\\mathbf{h}}` of Eq. (16),
        ``[K, N, d_h]`` (``[N, d_h]`` for 2-D inputs of a single copy)."""
        flat = h_u.dim() == 2
        if flat:
            h_u, h_i, te, x = (v.unsqueeze(0) for v in (h_u, h_i, te, x))
            delta_u, delta_i = delta_u.reshape(1, -1), delta_i.reshape(1, -1)
        z = event_context(h_u, h_i, te, x, delta_u, delta_i)
        out = self.prompted(z, torch.cat([h_u, h_i], -1), te, x)
        return out.squeeze(0) if flat else out

    def prompted(self, z: Tensor, pair: Tensor, te: Tensor, x: Tensor) -> Tensor:
        r"""Eqs. (14)-(16) from the event context ``z`` (Eq. 13) and ``pair``
        :math:`[\mathbf{h}_u \| \mathbf{h}_i]`, both ``[K, N, .]``: what :meth:`forward`
        computes after building them (a fit's every step reads the same two, so a caller
        may build them once)."""
        a_f, a_t = self.gates(z)
        gated = a_f * pair
        out = self.psi(torch.cat([gated, a_t * te, x], -1))
        if self.residual:  # the pre-training similarity template: the gated source state
            out = out + gated[..., : self.d_h]
        return out

    def num_values(self) -> int:
        """Float32 values of one copy's :math:`\\Delta\\Omega` (one client's message)."""
        return sum(p.numel() for p in self.parameters()) // self.copies

    def stacked(self, copies: int) -> PromptAdapter:
        """An adapter of ``copies`` stacked parameter sets (initialised from copy 0)."""
        out = PromptAdapter(**self.config, copies=copies)
        out.load_copies(self.state_dict())
        return out


ClassMasks = tuple[Tensor, Tensor, Tensor]  # class_masks: one-hot^T [K, C, N], counts, divisor


def class_masks(y: Tensor, mask: Tensor, num_classes: int, dtype: torch.dtype) -> ClassMasks:
    """What Eq. (18) reads of the labels alone: each client's class one-hot (transposed,
    ``[K, C, N]``, masked), its counts ``[K, C]`` and the divisor ``[K, C, 1]`` (counts, at
    least 1). The same for every step of a fit on one batch."""
    onehot = F.one_hot(y.clamp(min=0), num_classes).to(dtype) * mask.unsqueeze(-1).to(dtype)
    counts = onehot.sum(1)
    return onehot.transpose(1, 2), counts, counts.clamp(min=1).unsqueeze(-1)


def class_prototypes(
    h: Tensor, y: Tensor, mask: Tensor, num_classes: int, members: ClassMasks | None = None
) -> tuple[Tensor, Tensor]:
    """Eq. (18) per client: the mean prompted representation of each class, ``[K, C, d]``,
    and the support counts ``[K, C]`` (a class a client has no event of: zeros, count 0).
    ``members``: :func:`class_masks` of ``(y, mask)``, if already built."""
    onehot_t, counts, divisor = members or class_masks(y, mask, num_classes, h.dtype)
    q = torch.bmm(onehot_t, h) / divisor
    return q, counts


def prototypical_loss(
    h: Tensor,
    y: Tensor,
    mask: Tensor,
    num_classes: int,
    tau: float = 0.1,
    members: ClassMasks | None = None,
) -> Tensor:
    r"""Eq. (19): :math:`-\sum_{(e, y)} \log \mathrm{softmax}_c(s(\tilde{\mathbf{h}}_e,
    \mathbf{q}_c)/\tau)_y` over each client's local classes, summed over supports and clients."""
    q, counts = class_prototypes(h, y, mask, num_classes, members)
    logits = F.cosine_similarity(h.unsqueeze(2), q.unsqueeze(1), dim=-1) / tau  # [K, N, C]
    logits = logits.masked_fill((counts == 0).unsqueeze(1), float("-inf"))
    logp = logits.log_softmax(-1).gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -torch.where(mask, logp, torch.zeros_like(logp)).sum()


def link_loss(
    h_pos: Tensor, h_i: Tensor, h_neg: Tensor, h_j: Tensor, mask: Tensor, tau: float = 0.1
) -> Tensor:
    r"""Eqs. (20)-(21): :math:`-\sum \log \frac{e^{s(\tilde{\mathbf{h}}_{u,i}, \mathbf{h}_i)/\tau}}
    {e^{s(\tilde{\mathbf{h}}_{u,i}, \mathbf{h}_i)/\tau} + e^{s(\tilde{\mathbf{h}}_{u,j}, \mathbf{h}_j)/\tau}}`
    over the masked events."""
    pos = F.cosine_similarity(h_pos, h_i, dim=-1) / tau
    neg = F.cosine_similarity(h_neg, h_j, dim=-1) / tau
    nll = torch.logaddexp(pos, neg) - pos
    return torch.where(mask, nll, torch.zeros_like(nll)).sum()


def anchor_loss(q: Tensor, counts: Tensor, anchors: Tensor, has_anchor: Tensor) -> Tensor:
    r"""Eq. (22): :math:`\sum_{c \in \mathcal{Y}_k} \rho_{k,c} (1 - s(\mathbf{q}_{k,c},
    \bar{\mathbf{q}}_c))` with :math:`\rho_{k,c} = n_{k,c} / n_k`, summed over clients.

    ``q``, ``counts``: :func:`class_prototypes`; ``anchors`` ``[C, d]`` with ``has_anchor``
    ``[C]``: a class the server has no anchor for yet is skipped (docs/readings.md), while
    :math:`n_k` still counts all of the client's support."""
    rho = counts / counts.sum(1, keepdim=True).clamp(min=1)
    cos = F.cosine_similarity(q, anchors.unsqueeze(0).to(q), dim=-1)
    keep = (counts > 0) & has_anchor.unsqueeze(0)
    return (rho * (1 - cos) * keep).sum()


def proximal_adapter(adapter: nn.Module, start: dict[str, Tensor]) -> Tensor:
    r"""The proximal term of Eq. (26) without its weight: :math:`\lVert\Omega_k - \Omega^{(r)}\rVert_2^2`,
    summed over the copies (``start`` broadcasts over them)."""
    return sum(((p - start[n]) ** 2).sum() for n, p in adapter.named_parameters())


def flat_start(adapter: nn.Module, start: dict[str, Tensor]) -> Tensor:
    r""":math:`\Omega^{(r)}` (single-copy ``start``) repeated over the adapter's copies and
    flattened in parameter order: the reference of :func:`proximal_flat`."""
    return torch.cat([start[n].expand_as(p).reshape(-1) for n, p in adapter.named_parameters()])


def proximal_flat(params: Sequence[Tensor], start: Tensor) -> Tensor:
    r"""The proximal term of Eq. (26) without its weight over all parameters at once
    (``start``: :func:`flat_start`; ``params``: the adapter's, in order). Its gradient is
    bitwise :func:`proximal_adapter`'s from a dozen autograd nodes instead of four per
    parameter; the loss value is summed in another order."""
    flat = torch.cat([p.reshape(-1) for p in params])
    return ((flat - start) ** 2).sum()
