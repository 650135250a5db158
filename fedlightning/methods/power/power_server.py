"""POWER's server (docs/fedogl.md, "POWER"): the shared gradient encoder GE, labels from class
gradients, pseudo-prototypes by gradient matching, distillation on the pseudo-nodes."""

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
    """GE's ``lin1..lin4`` (``in_dim -> 128 -> 128 -> 64 -> num_classes``), drawn as
    ``nn.Linear`` draws them from ``generator``."""
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
    """One class's message: the gradient of GE's cross-entropy at ``prototype`` [D]."""
    leaves = {
        k: v if v.requires_grad else v.detach().requires_grad_(True) for k, v in params.items()
    }
    loss = F.cross_entropy(ge_forward(leaves, prototype.unsqueeze(0)), torch.tensor([label]))
    grads = torch.autograd.grad(loss, list(leaves.values()), create_graph=create_graph)
    return dict(zip(leaves, grads, strict=True))


def gradient_label(grads: dict[str, Tensor]) -> int:
    """The label of a one-sample CE gradient: the argmin of the last bias's (``softmax - e_c``)."""
    last = max(int(k[3:].split(".")[0]) for k in grads)
    return int(torch.argmin(grads[f"lin{last}.bias"]))


def gradient_distance(a: dict[str, Tensor], b: dict[str, Tensor]) -> Tensor:
    """The gradient-matching loss, the summed squared differences."""
    return sum(((a[k] - b[k]) ** 2).sum() for k in b)


def gradient_match(
    params: dict[str, Tensor], x: Tensor, labels: Tensor, targets: dict[str, Tensor]
) -> Tensor:
    """:func:`gradient_distance` [n] of :func:`class_gradient` at each row of ``x`` to
    ``targets`` [n, ...], by backpropagation written out (``|d h^T - G|^2 = |d|^2 |h|^2 -
    2 d^T G h + |G|^2``) without per-row gradients; float64, differentiable in ``x``."""
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
    """L-BFGS on the ``n`` independent rows of ``x`` (``fun(x)`` [n]), each moving as
    ``torch.optim.LBFGS`` without line search would; a row stops at ``floor``, at
    ``tolerance_grad`` or without a descent direction. Yields ``(iteration, x)``; ``(-1, x)``
    once every row has stopped."""
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
    """Pseudo-prototypes [n, keep, D] whose GE gradients match the uploads ``targets``:
    ``steps x max_iter`` :func:`batched_lbfgs` iterations from ``start``, the iterates ending
    the last ``keep`` steps; a row stops below ``tol`` times its target's squared norm."""
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
    """Distillation weights [K, C]: ``sum_s decay^(t-s) N_s`` of the uploaded class counts,
    each column scaled to sum to one."""
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
    """POWER's server objective: ``sum_k sum_c W[k, c]`` times class ``c``'s mean L1 logit gap
    (per class) between the global model and client ``k``."""
    total = global_logits.sum() * 0.0
    for k, local in enumerate(local_logits):
        per_node = (global_logits - local).abs().mean(1)
        for c in labels.unique().tolist():
            w = float(weights[k, c])
            if w:
                total = total + w * per_node[labels == c].mean()
    return total


class PowerMemory(ServerModule):
    """The pseudo-node memory: uploaded class gradients become labels, counts and
    pseudo-prototypes; after each FedAvg the global model (``net``'s architecture) takes
    ``epochs`` Adam steps of :func:`distillation_loss` on all pseudo-nodes so far."""

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
        """Labels, counts and pseudo-prototypes of ``(client, slot, fields, count)`` uploads."""
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
