"""POWER's server part (Zhu, Hu and Wu, *Federated Continual Graph Learning*, KDD 2025;
docs/fedogl.md, "POWER"): the shared gradient encoder GE, label inference from a class
gradient, pseudo-prototype reconstruction by gradient matching, and server-side
distillation of the aggregated model towards the clients' models on the pseudo-nodes. No
Lightning here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlightning.messages import ClientUpdate
from fedlightning.server.aggregate import model_state
from fedlightning.server.server import ServerModule

GRAD_PREFIX = "power_grad."  # power_grad.<slot>.<GE parameter>
COUNT_PREFIX = "power_count."  # power_count.<slot>
GE_WIDTHS = (128, 128, 64)  # the hidden widths of the original's GE


def ge_parameters(in_dim: int, num_classes: int, generator: torch.Generator) -> dict[str, Tensor]:
    """GE's weights, ``lin1..lin4`` (``in_dim -> 128 -> 128 -> 64 -> num_classes``), drawn
    as :class:`torch.nn.Linear` draws them (``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` for the
    weight and the bias) from ``generator``: every party that knows the seed holds the
    same encoder."""
    dims = (in_dim, *GE_WIDTHS, num_classes)
    out = {}
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:], strict=True), start=1):
        bound = 1.0 / math.sqrt(a)
        out[f"lin{i}.weight"] = (torch.rand(b, a, generator=generator) * 2 - 1) * bound
        out[f"lin{i}.bias"] = (torch.rand(b, generator=generator) * 2 - 1) * bound
    return out


def ge_forward(params: dict[str, Tensor], x: Tensor) -> Tensor:
    """GE's logits ``[n, C]`` of inputs ``x`` ``[n, D]``: linear layers with ReLU between."""
    layers = len(params) // 2
    for i in range(1, layers + 1):
        x = F.linear(x, params[f"lin{i}.weight"], params[f"lin{i}.bias"])
        if i < layers:
            x = torch.relu(x)
    return x


def class_gradient(
    params: dict[str, Tensor], prototype: Tensor, label: int, create_graph: bool = False
) -> dict[str, Tensor]:
    r"""The uploaded message of one class: :math:`\nabla_\theta \mathrm{CE}(GE_\theta(\bar
    x_c), c)`, the gradient of GE's cross-entropy at the class prototype ``prototype``
    ``[D]``, by parameter name."""
    leaves = {
        k: v if v.requires_grad else v.detach().requires_grad_(True) for k, v in params.items()
    }
    loss = F.cross_entropy(ge_forward(leaves, prototype.unsqueeze(0)), torch.tensor([label]))
    grads = torch.autograd.grad(loss, list(leaves.values()), create_graph=create_graph)
    return dict(zip(leaves, grads, strict=True))


def gradient_label(grads: dict[str, Tensor]) -> int:
    r"""The class of a one-sample CE gradient: the argmin of the last layer's bias gradient
    :math:`\partial \mathrm{CE} / \partial b = \mathrm{softmax}(z) - e_c`, negative only at
    the label."""
    last = max(int(k[3:].split(".")[0]) for k in grads)
    return int(torch.argmin(grads[f"lin{last}.bias"]))


def gradient_distance(a: dict[str, Tensor], b: dict[str, Tensor]) -> Tensor:
    r""":math:`\sum_p \lVert a_p - b_p \rVert_2^2`, the gradient-matching loss."""
    return sum(((a[k] - b[k]) ** 2).sum() for k in b)


def reconstruct_prototype(
    params: dict[str, Tensor],
    target: dict[str, Tensor],
    label: int,
    generator: torch.Generator,
    steps: int = 30,
    max_iter: int = 20,
    lr: float = 1.0,
    keep: int = 1,
    tol: float = 1e-9,
) -> Tensor:
    r"""Pseudo-prototypes ``[keep, D]`` of class ``label`` whose GE gradient matches
    ``target``: :math:`\min_x \sum_p \lVert \nabla_p \mathrm{CE}(GE(x), c) - g_p
    \rVert^2` by L-BFGS (``steps`` calls of ``max_iter`` evaluations, learning rate
    ``lr``) from :math:`x \sim \mathcal{N}(0, I)` drawn from ``generator``; the iterates of
    the last ``keep`` steps (the original's ``num_recon_nodes``). Stops early once a step
    starts at a loss of at most ``tol`` x :math:`\sum_p \lVert g_p \rVert^2` (converged;
    the remaining iterates would repeat it)."""
    frozen = {k: v.detach() for k, v in params.items()}
    dim = frozen["lin1.weight"].size(1)
    x = torch.randn(dim, generator=generator).requires_grad_(True)
    opt = torch.optim.LBFGS([x], lr=lr, max_iter=max_iter)

    def closure() -> Tensor:
        opt.zero_grad()
        loss = gradient_distance(class_gradient(frozen, x, label, create_graph=True), target)
        loss.backward()
        return loss

    floor = tol * float(gradient_distance({k: v * 0 for k, v in target.items()}, target))
    kept = []
    for step in range(steps):
        start = float(opt.step(closure).detach())  # the loss before this step's update
        if step >= steps - keep:
            kept.append(x.detach().clone())
        if start <= floor:  # converged to float precision: the later iterates are this one
            kept += [x.detach().clone()] * (keep - len(kept))
            break
    return torch.stack(kept)


def distillation_weights(
    counts: dict[int, dict[int, Tensor]], stage: int, clients: Sequence[int], decay: float
) -> Tensor:
    r"""The weight of client ``k`` and class ``c`` in the server's distillation, ``[K, C]``:
    :math:`W = N_t + \sum_{s<t} q^{t-s} N_s` (``N_s[k, c]``: the count client ``k``
    uploaded for class ``c`` at stage ``s``; ``q``: ``decay``), each class's column scaled
    to sum to one over ``clients`` (a column of zeros stays zero)."""
    rows = []
    for k in clients:
        total = None
        for s, by_client in counts.items():
            if s > stage or k not in by_client:
                continue
            part = by_client[k].to(torch.float64) * decay ** (stage - s)
            total = part if total is None else total + part
        rows.append(total)
    width = next((r.numel() for r in rows if r is not None), 0)
    w = torch.stack([r if r is not None else torch.zeros(width, dtype=torch.float64) for r in rows])
    col = w.sum(0, keepdim=True)
    return torch.where(col > 0, w / col.clamp(min=1e-300), torch.zeros_like(w))


def distillation_loss(
    global_logits: Tensor, local_logits: Sequence[Tensor], weights: Tensor, labels: Tensor
) -> Tensor:
    r"""POWER's server objective on the pseudo-nodes (labels ``labels`` ``[n]``):
    :math:`\sum_k \sum_c W_{k,c} \frac{1}{n_c} \sum_{i: y_i = c} \frac{1}{C} \lVert
    z^g_i - z^k_i \rVert_1`, ``z^g`` the global model's logits ``[n, C]``, ``z^k``
    client ``k``'s, ``W`` ``[K, C]`` from :func:`distillation_weights`."""
    total = global_logits.sum() * 0.0
    for k, local in enumerate(local_logits):
        per_node = (global_logits - local).abs().mean(1)
        for c in labels.unique().tolist():
            w = float(weights[k, c])
            if w:
                total = total + w * per_node[labels == c].mean()
    return total


class PowerMemory(ServerModule):
    """The server's pseudo-node memory and distillation.

    In a stage's first round each client's ``power_grad.<j>.*`` (one class's GE gradient)
    and ``power_count.<j>`` are turned into a label (:func:`gradient_label`), a class count
    (per stage and client) and ``keep`` pseudo-prototypes (:func:`reconstruct_prototype`).
    After every round's FedAvg the global model takes ``epochs`` Adam steps (``lr``) on
    :func:`distillation_loss` against the round's client models on all pseudo-nodes so far.

    Args:
        net: a module of the global model's architecture (its forward is called with the
            state dicts by :func:`torch.func.functional_call`; eval mode).
        pseudo_graph: ``x [n, D] -> input of net`` (the pseudo-nodes as isolated nodes).
        ge: ``() -> GE's parameters`` (the run's shared encoder).
        stage_of: ``round -> stage``.
        decay, lr, epochs, weight_decay: ``q``; the server's Adam (learning rate, steps per
            round, weight decay).
        recon: :func:`reconstruct_prototype`'s ``steps``, ``max_iter``, ``lr``, ``keep``.
        generator: ``(round, client, slot) -> torch.Generator`` of the start point.
    """

    def __init__(
        self,
        net: nn.Module,
        pseudo_graph: Callable[[Tensor], Any],
        ge: Callable[[], dict[str, Tensor]],
        stage_of: Callable[[int], int],
        generator: Callable[[int, int, int], torch.Generator],
        decay: float = 0.3,
        lr: float = 0.01,
        epochs: int = 3,
        weight_decay: float = 5e-4,
        recon: dict[str, Any] | None = None,
    ) -> None:
        self.net, self.pseudo_graph, self.ge, self.stage_of = net, pseudo_graph, ge, stage_of
        self.generator = generator
        self.decay, self.lr, self.epochs = decay, lr, int(epochs)
        self.weight_decay = weight_decay
        self.recon = dict(recon or {})
        self.counts: dict[int, dict[int, Tensor]] = {}  # stage -> client -> [C]
        self.x = torch.zeros(0, 0)  # pseudo-nodes [n, D]
        self.y = torch.zeros(0, dtype=torch.long)
        self.match: list[float] = []  # final gradient distance of each reconstruction
        self._locals: list[tuple[int, dict[str, Tensor]]] = []

    def aggregate(self, round: int, updates: Sequence[ClientUpdate]) -> None:
        t = self.stage_of(round)
        self._locals = [(u.client_id, model_state(u.tensors)) for u in updates]
        for u in updates:
            slots = sorted({k[len(GRAD_PREFIX) :].split(".")[0] for k in u.tensors if k.startswith(GRAD_PREFIX)}, key=int)  # fmt: skip
            for j in slots:
                pre = f"{GRAD_PREFIX}{j}."
                grads = {k[len(pre) :]: v for k, v in u.tensors.items() if k.startswith(pre)}
                self.add(t, u.client_id, grads, u.scalars[f"{COUNT_PREFIX}{j}"], round, int(j))

    def add(
        self, t: int, client: int, grads: dict[str, Tensor], count: float, round: int, slot: int
    ) -> None:
        """One uploaded class gradient: its label, its count, its pseudo-prototypes."""
        params = self.ge()
        label = gradient_label(grads)
        row = self.counts.setdefault(t, {}).setdefault(
            client, torch.zeros(params["lin4.bias"].numel(), dtype=torch.float64)
        )
        row[label] += count
        xs = reconstruct_prototype(
            params, grads, label, self.generator(round, client, slot), **self.recon
        )
        self.match.append(float(gradient_distance(class_gradient(params, xs[-1], label), grads)))
        self.x = xs if self.x.numel() == 0 else torch.cat([self.x, xs])
        self.y = torch.cat([self.y, torch.full((xs.size(0),), label, dtype=torch.long)])

    def update_global(self, round: int, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The FedAvg model after ``epochs`` steps of :func:`distillation_loss`."""
        if self.epochs == 0 or self.y.numel() == 0 or not self._locals:
            return state
        clients = [k for k, _ in self._locals]
        weights = distillation_weights(self.counts, self.stage_of(round), clients, self.decay)
        graph = self.pseudo_graph(self.x)
        was = self.net.training
        self.net.eval()
        with torch.no_grad():
            local = [torch.func.functional_call(self.net, s, (graph,)) for _, s in self._locals]
        train = {
            k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in state.items()
        }
        params = [v for v in train.values() if v.requires_grad]
        opt = torch.optim.Adam(params, lr=self.lr, weight_decay=self.weight_decay)
        for _ in range(self.epochs):
            opt.zero_grad()
            out = torch.func.functional_call(self.net, train, (graph,))
            distillation_loss(out, local, weights, self.y).backward()
            opt.step()
        self.net.train(was)
        self._locals = []
        return {k: v.detach() for k, v in train.items()}

    def state_dict(self) -> dict[str, Any]:
        return {
            "counts": {t: dict(rows) for t, rows in self.counts.items()},
            "x": self.x,
            "y": self.y,
            "match": list(self.match),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts = {
            int(t): {int(k): v for k, v in rows.items()} for t, rows in state["counts"].items()
        }
        self.x, self.y, self.match = state["x"], state["y"], list(state["match"])
