"""POWER's server part (Zhu, Hu and Wu, *Federated Continual Graph Learning*, KDD 2025;
docs/fedogl.md, "POWER"): the shared gradient encoder GE, label inference from a class
gradient, pseudo-prototype reconstruction by gradient matching, and server-side
distillation of the aggregated model towards the clients' models on the pseudo-nodes. No
Lightning here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
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


def gradient_match(
    params: dict[str, Tensor], x: Tensor, labels: Tensor, targets: dict[str, Tensor]
) -> Tensor:
    r""":func:`gradient_distance` between :func:`class_gradient` at each row of ``x``
    ``[n, D]`` (label ``labels[i]``) and the uploaded ``targets`` (fields ``[n, ...]``),
    ``[n]``, without forming the per-row gradients: backpropagation written out, with
    :math:`h_0 = x`, :math:`a_l = W_l h_{l-1} + b_l`, :math:`h_l = \mathrm{relu}(a_l)`,
    :math:`\delta_L = \mathrm{softmax}(a_L) - e_c`, :math:`\delta_l = W_{l+1}^\top
    \delta_{l+1} \odot [a_l > 0]`, a weight's gradient is :math:`\delta_l h_{l-1}^\top`,
    so :math:`\lVert \delta_l h_{l-1}^\top - G_l \rVert^2 = \lVert \delta_l \rVert^2
    \lVert h_{l-1} \rVert^2 - 2\, \delta_l^\top G_l h_{l-1} + \lVert G_l \rVert^2`, and a
    bias's :math:`\lVert \delta_l - g_l \rVert^2`. In float64 (the three terms nearly
    cancel at a match); differentiable in ``x``."""
    f64 = {k: v.to(torch.float64) for k, v in params.items()}
    layers = len(f64) // 2
    h, pre = [x.to(torch.float64)], []
    for i in range(1, layers + 1):
        pre.append(F.linear(h[-1], f64[f"lin{i}.weight"], f64[f"lin{i}.bias"]))
        h.append(torch.relu(pre[-1]))
    delta = torch.softmax(pre[-1], dim=1) - F.one_hot(labels, pre[-1].size(1)).to(torch.float64)
    total = x.new_zeros(x.size(0), dtype=torch.float64)
    for i in range(layers, 0, -1):
        w, b = targets[f"lin{i}.weight"].to(torch.float64), targets[f"lin{i}.bias"]
        cross = (delta.unsqueeze(1) @ w @ h[i - 1].unsqueeze(2)).view(-1)
        total = total + (delta**2).sum(1) * (h[i - 1] ** 2).sum(1) - 2 * cross
        total = total + (w**2).flatten(1).sum(1) + ((delta - b.to(torch.float64)) ** 2).sum(1)
        if i > 1:
            delta = (delta @ f64[f"lin{i}.weight"]) * (pre[i - 2] > 0).to(torch.float64)
    return total


def batched_lbfgs(
    fun: Callable[[Tensor], Tensor],
    x: Tensor,
    iters: int,
    lr: float = 1.0,
    history: int = 100,
    floor: Tensor | None = None,
    tolerance_grad: float = 1e-7,
) -> Iterator[tuple[int, Tensor]]:
    r"""L-BFGS on ``n`` independent problems at once: ``fun(x)`` ``[n]`` is problem
    ``i``'s loss at row ``x[i]`` (row ``i`` of its gradient depends on ``x[i]`` alone).
    Each problem keeps its own curvature pairs (the last ``history`` iterations) and moves
    as :class:`torch.optim.LBFGS` without line search would move it alone: first step
    :math:`-\min(1, 1/\lVert g\rVert_1)\,\mathrm{lr}\, g`, then ``lr`` times the two-loop
    direction; a pair with :math:`y^\top s \le 10^{-10}` is skipped. A problem stops (its row
    frozen) once its loss is at most ``floor[i]``, its largest gradient entry at most
    ``tolerance_grad``, or its direction is no descent direction (:math:`g^\top d >
    -10^{-9}`; LBFGS would not move again: the next pair is skipped, the direction the
    same). Yields ``(iteration, x)`` after each of ``iters`` iterations (and
    stops early once every problem has stopped, yielding the final ``x`` once more as
    iteration ``-1``)."""
    x = x.detach().clone()
    n = x.size(0)
    floor = torch.full((n,), -1.0) if floor is None else floor
    s_hist, y_hist, ro_hist = [], [], []
    h_diag = torch.ones(n, 1, dtype=x.dtype)
    g_prev = d = t = None
    done = torch.zeros(n, dtype=torch.bool)
    for it in range(iters):
        x.requires_grad_(True)
        with torch.enable_grad():
            loss = fun(x)
            (g,) = torch.autograd.grad(loss.sum(), [x])
        x = x.detach()
        done |= (loss.detach() <= floor) | (g.abs().amax(1) <= tolerance_grad)
        if bool(done.all()):
            yield -1, x
            return
        if it == 0:
            d = -g
            t = (lr * torch.clamp(1.0 / g.abs().sum(1, keepdim=True), max=1.0)).to(x.dtype)
        else:
            y, s = g - g_prev, d * t
            ys = (y * s).sum(1, keepdim=True)
            ok = ys > 1e-10
            s_hist.append(s)
            y_hist.append(y)
            ro_hist.append(torch.where(ok, 1.0 / ys.clamp(min=1e-300), torch.zeros_like(ys)))
            if len(s_hist) > history:
                s_hist.pop(0), y_hist.pop(0), ro_hist.pop(0)
            yy = (y * y).sum(1, keepdim=True)
            h_diag = torch.where(ok, ys / yy.clamp(min=1e-300), h_diag)
            q, al = -g, []
            for s_i, y_i, ro_i in zip(
                reversed(s_hist), reversed(y_hist), reversed(ro_hist), strict=True
            ):
                al.append(ro_i * (s_i * q).sum(1, keepdim=True))
                q = q - al[-1] * y_i
            d = q * h_diag
            for s_i, y_i, ro_i, a_i in zip(s_hist, y_hist, ro_hist, reversed(al), strict=True):
                d = d + (a_i - ro_i * (y_i * d).sum(1, keepdim=True)) * s_i
            t = torch.full_like(t, lr)
        done |= (g * d).sum(1) > -1e-9  # no descent direction: stuck there for good
        if bool(done.all()):
            yield -1, x
            return
        d = torch.where(done.unsqueeze(1), torch.zeros_like(d), d)
        g_prev = g
        x = x + t * d
        yield it, x


def reconstruct_prototypes(
    params: dict[str, Tensor],
    targets: dict[str, Tensor],
    labels: Tensor,
    start: Tensor,
    steps: int = 20,
    max_iter: int = 20,
    lr: float = 1.0,
    keep: int = 1,
    tol: float = 1e-8,
) -> Tensor:
    r"""Pseudo-prototypes ``[n, keep, D]``, for each of ``n`` uploads (``targets``: GE's
    gradient fields ``[n, ...]``, ``labels`` ``[n]``) one whose GE gradient matches it:
    :math:`\min_x \sum_p \lVert \nabla_p \mathrm{CE}(GE(x), c) - g_p \rVert^2` by L-BFGS
    (:func:`batched_lbfgs`, all uploads at once, each its own problem) from ``start``
    ``[n, D]`` (draws of :math:`\mathcal{N}(0, I)`): ``steps`` x ``max_iter`` iterations
    of learning rate ``lr``; the iterates at the end of the last ``keep`` steps of
    ``max_iter`` (the original's ``num_recon_nodes``). A problem stops once its loss is at
    most ``tol`` x :math:`\sum_p \lVert g_p \rVert^2` (converged: its later iterates
    would repeat it)."""
    frozen = {k: v.detach().to(torch.float64) for k, v in params.items()}
    targets = {k: v.detach().to(torch.float64) for k, v in targets.items()}
    norms = sum((v**2).flatten(1).sum(1) for v in targets.values())

    def loss(x: Tensor) -> Tensor:
        return gradient_match(frozen, x, labels, targets)

    kept: list[Tensor] = []
    for it, x in batched_lbfgs(loss, start.to(torch.float64), steps * max_iter, lr, floor=tol * norms):  # fmt: skip
        if it < 0:  # every problem converged: the later iterates are this one
            kept += [x] * (keep - len(kept))
            break
        if (it + 1) % max_iter == 0 and (it + 1) // max_iter > steps - keep:
            kept.append(x)
    return torch.stack(kept, 1).to(start.dtype)


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
    (per stage and client) and ``keep`` pseudo-prototypes (:func:`reconstruct_prototypes`).
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
        recon: :func:`reconstruct_prototypes`'s ``steps``, ``max_iter``, ``lr``, ``keep``.
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
        uploads = []  # (client, slot, gradient fields, count), in client and slot order
        for u in updates:
            slots = sorted({k[len(GRAD_PREFIX) :].split(".")[0] for k in u.tensors if k.startswith(GRAD_PREFIX)}, key=int)  # fmt: skip
            for j in slots:
                pre = f"{GRAD_PREFIX}{j}."
                grads = {k[len(pre) :]: v for k, v in u.tensors.items() if k.startswith(pre)}
                uploads.append((u.client_id, int(j), grads, u.scalars[f"{COUNT_PREFIX}{j}"]))
        if uploads:
            self.add(t, round, uploads)

    def add(self, t: int, round: int, uploads: Sequence[tuple[int, int, dict, float]]) -> None:
        """A round's uploaded class gradients ``(client, slot, fields, count)``: their
        labels, their counts, their pseudo-prototypes (reconstructed together)."""
        params = self.ge()
        width = params["lin4.bias"].numel()
        labels = torch.tensor([gradient_label(g) for _, _, g, _ in uploads])
        for (client, _, _, count), label in zip(uploads, labels.tolist(), strict=True):
            row = self.counts.setdefault(t, {}).setdefault(
                client, torch.zeros(width, dtype=torch.float64)
            )
            row[label] += count
        targets = {k: torch.stack([g[k] for _, _, g, _ in uploads]) for k in params}
        dim = params["lin1.weight"].size(1)
        start = torch.stack([torch.randn(dim, generator=self.generator(round, k, j)) for k, j, _, _ in uploads])  # fmt: skip
        xs = reconstruct_prototypes(params, targets, labels, start, **self.recon)
        self.match += gradient_match(params, xs[:, -1], labels, targets).tolist()
        xs = xs.flatten(0, 1)
        self.x = xs if self.x.numel() == 0 else torch.cat([self.x, xs])
        self.y = torch.cat([self.y, labels.repeat_interleave(self.recon.get("keep", 1))])

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
