"""FedOGL's prototype memory, Eqs. (11)-(14), over plain tensors in the head's input space."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlightning.server.aggregate import normalized_weights

__all__ = [
    "PrototypeBank",
    "client_consensus",
    "local_prototypes",
    "propagate",
    "prototype_graph",
    "refine_head",
    "refinement_loss",
    "sgd_refine",
]


# Hand-written (not scikit-learn's KMeans) to stay bitwise the same on every runner.
def _kmeans(x: Tensor, k: int, seed: int, iters: int) -> Tensor:
    """Cluster of each row: a seeded first row, farthest-point seeding, <= ``iters`` Lloyd
    steps (an emptied centre stays put)."""
    n = x.shape[0]
    g = torch.Generator().manual_seed(int(seed))
    first = int(torch.randint(n, (1,), generator=g))
    centres = [x[first]]
    d2 = ((x - x[first]) ** 2).sum(1)
    for _ in range(1, k):
        nxt = int(torch.argmax(d2))
        centres.append(x[nxt])
        d2 = torch.minimum(d2, ((x - x[nxt]) ** 2).sum(1))
    c = torch.stack(centres)
    assign = torch.cdist(x, c).argmin(1)
    for _ in range(iters):
        for j in range(k):
            members = assign == j
            if members.any():
                c[j] = x[members].mean(0)
        new = torch.cdist(x, c).argmin(1)
        if torch.equal(new, assign):
            break
        assign = new
    return assign


def local_prototypes(
    z: Tensor,
    y: Tensor,
    classes: Sequence[int],
    modes: int = 1,
    seed: int = 0,
    iters: int = 20,
) -> dict[int, list[tuple[Tensor, int]]]:
    """A client's prototypes ``{c: [(mean of z, support), ...]}``, Eq. (11): each class of
    ``z`` [N, d] (Eq. 10) split into ``min(modes, n_c)`` k-means modes; empty ones dropped."""
    if z.dim() != 2 or y.shape != (z.shape[0],):
        raise ValueError(f"expected z [N, d] and y [N], got {tuple(z.shape)}, {tuple(y.shape)}")
    if modes < 1:
        raise ValueError(f"modes must be >= 1, got {modes}")
    z = z.detach()
    y = y.to(z.device)
    out: dict[int, list[tuple[Tensor, int]]] = {}
    for c in classes:
        zc = z[y == c]
        n_c = zc.shape[0]
        if n_c == 0:
            continue
        k = min(modes, n_c)
        if k == 1:
            out[int(c)] = [(zc.mean(0), n_c)]
            continue
        assign = _kmeans(zc.double(), k, seed, iters)
        protos = []
        for j in range(k):
            members = assign == j
            if members.any():
                protos.append((zc[members].mean(0), int(members.sum())))
        out[int(c)] = protos
    return out


class PrototypeBank:
    """The server's prototype memory of Eq. (12): ``slots`` per class; a prototype merges
    (support-weighted) into its most cosine-similar slot above ``eta``, else fills an empty
    slot or replaces the smallest-support one (docs/fedogl.md)."""

    def __init__(self, slots: int = 4, eta: float = 0.8) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = int(slots)
        self.eta = float(eta)
        self._bank: dict[int, list[tuple[Tensor, int]]] = {}
        self._dim: int | None = None

    def __len__(self) -> int:
        return sum(len(v) for v in self._bank.values())

    def update(self, c: int, p: Tensor, n: int) -> str:
        """Consolidate ``p`` of class ``c``: ``merged``, ``filled`` or ``replaced``."""
        p = p.detach()
        if p.dim() != 1:
            raise ValueError(f"a prototype is a vector [d], got shape {tuple(p.shape)}")
        if self._dim is not None and p.shape[0] != self._dim:
            raise ValueError(f"prototype of dimension {p.shape[0]}, the bank holds {self._dim}")
        if n <= 0:
            raise ValueError(f"support size must be positive, got {n}")
        n = int(n)
        self._dim = int(p.shape[0])
        bank = self._bank.setdefault(int(c), [])
        if bank:
            stored = torch.stack([q.to(device=p.device, dtype=torch.float64) for q, _ in bank])
            cos = F.cosine_similarity(stored, p.double().unsqueeze(0), dim=1)
            j = int(torch.argmax(cos))
            if float(cos[j]) > self.eta:
                q, m = bank[j]
                merged = (m * q.double().to(p.device) + n * p.double()) / (m + n)
                bank[j] = (merged.to(q.dtype), m + n)
                return "merged"
        if len(bank) < self.slots:
            bank.append((p.clone(), n))
            return "filled"
        weakest = min(range(len(bank)), key=lambda i: (bank[i][1], i))
        bank[weakest] = (p.clone(), n)
        return "replaced"

    def prototypes(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(P [m, d], labels [m], counts [m])`` of the occupied slots, by class then slot."""
        rows = [(c, q, n) for c in sorted(self._bank) for q, n in self._bank[c]]
        if not rows:
            return (
                torch.zeros(0, self._dim or 0),
                torch.zeros(0, dtype=torch.long),
                torch.zeros(0, dtype=torch.long),
            )
        dev = rows[0][1].device
        P = torch.stack([q.to(dev) for _, q, _ in rows])
        labels = torch.tensor([c for c, _, _ in rows], dtype=torch.long)
        counts = torch.tensor([n for _, _, n in rows], dtype=torch.long)
        return P, labels, counts

    def state_dict(self) -> dict[str, Any]:
        P, labels, counts = self.prototypes()
        return {
            "slots": self.slots,
            "eta": self.eta,
            "prototypes": P.clone(),
            "labels": labels,
            "counts": counts,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.slots = int(state["slots"])
        self.eta = float(state["eta"])
        P, labels, counts = state["prototypes"], state["labels"], state["counts"]
        self._bank = {}
        # saved in slot order, so appending restores every slot index (which breaks ties)
        for q, c, n in zip(P, labels.tolist(), counts.tolist(), strict=True):
            self._bank.setdefault(int(c), []).append((q.clone(), int(n)))
        self._dim = int(P.shape[1]) if P.shape[0] > 0 else None


def prototype_graph(P: Tensor, labels: Tensor, kappa: int) -> Tensor:
    """The prototype graph of Eq. (13), dense 0/1 [m, m]: each row's ``kappa`` most
    cosine-similar (symmetrised) plus every same-class pair; no self loops."""
    if P.dim() != 2 or labels.shape != (P.shape[0],):
        raise ValueError(
            f"expected P [m, d] and labels [m], got {tuple(P.shape)}, {tuple(labels.shape)}"
        )
    if kappa < 0:
        raise ValueError(f"kappa must be >= 0, got {kappa}")
    m = P.shape[0]
    P = P.detach()
    eye = torch.eye(m, dtype=torch.bool, device=P.device)
    A = torch.zeros(m, m, dtype=torch.bool, device=P.device)
    k = min(int(kappa), m - 1)
    if k > 0:
        Pn = F.normalize(P.double(), dim=1)
        sim = (Pn @ Pn.T).masked_fill(eye, float("-inf"))
        idx = torch.sort(sim, dim=1, descending=True, stable=True).indices[:, :k]
        A[torch.arange(m, device=P.device).unsqueeze(1), idx] = True
        A = A | A.T
    lab = labels.to(P.device)
    A = A | ((lab.unsqueeze(0) == lab.unsqueeze(1)) & ~eye)
    return A.to(P.dtype)


def propagate(P: Tensor, A: Tensor) -> Tensor:
    """``D^-1/2 (A + I) D^-1/2 P``, Eq. (13) (docs/readings.md)."""
    m = P.shape[0]
    if A.shape != (m, m):
        raise ValueError(f"expected A [{m}, {m}] for P {tuple(P.shape)}, got {tuple(A.shape)}")
    A_hat = A.to(P.dtype) + torch.eye(m, dtype=P.dtype, device=P.device)
    d_inv_sqrt = A_hat.sum(1).rsqrt()
    return d_inv_sqrt.unsqueeze(1) * (A_hat @ (d_inv_sqrt.unsqueeze(1) * P))


def _known_positions(labels: Tensor, known: Tensor) -> Tensor:
    """Position of each label inside ``known``; a label outside ``known`` is an error."""
    hit = labels.unsqueeze(1) == known.unsqueeze(0)
    missing = ~hit.any(1)
    if missing.any():
        raise ValueError(
            f"prototype labels {sorted(set(labels[missing].tolist()))} are not among the "
            f"known classes {known.tolist()}"
        )
    return hit.long().argmax(1)


def client_consensus(
    heads: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float],
    P_tilde: Tensor,
    known: Tensor | Sequence[int],
) -> Tensor:
    """Eq. (14)'s ``q_cli`` [m, |known|]: the weighted mean of the recent ``Linear`` heads'
    softmax over the ``known`` columns of ``P_tilde``."""
    w = normalized_weights(heads, weights, "head")
    known = torch.as_tensor(known, dtype=torch.long, device=P_tilde.device)
    x = P_tilde.detach().double()
    q = torch.zeros(x.shape[0], known.numel(), dtype=torch.float64, device=x.device)
    for wr, sd in zip(w.tolist(), heads, strict=True):
        W = sd["weight"].detach().double().to(x.device)[known]
        b = sd.get("bias")
        b = None if b is None else b.detach().double().to(x.device)[known]
        q += wr * F.linear(x, W, b).softmax(dim=1)
    return q.to(P_tilde.dtype)


def refinement_loss(
    head: nn.Module,
    P_tilde: Tensor,
    labels: Tensor,
    q_cli: Tensor | None,
    known: Tensor | Sequence[int],
    lambda_lab: float = 1.0,
    lambda_tr: float = 1.0,
) -> Tensor:
    """Eq. (14)'s bracket: ``lambda_lab`` CE + ``lambda_tr`` KL(q_cli || softmax of the head's
    ``known`` columns), means over prototypes; ``q_cli=None`` drops the KL."""
    m = P_tilde.shape[0]
    known = torch.as_tensor(known, dtype=torch.long, device=P_tilde.device)
    logits = head(P_tilde)[:, known]
    log_q = logits.log_softmax(dim=1)
    w = torch.full((m,), 1.0 / m, dtype=log_q.dtype, device=log_q.device)
    target = _known_positions(labels.to(known.device), known)
    ce = -(log_q.gather(1, target.unsqueeze(1)).squeeze(1) * w).sum()
    loss = lambda_lab * ce
    if q_cli is not None:
        if q_cli.shape != log_q.shape:
            raise ValueError(
                f"q_cli must be [m, |known|] = {tuple(log_q.shape)}, got {tuple(q_cli.shape)}"
            )
        q = q_cli.detach().to(device=log_q.device, dtype=log_q.dtype)
        kl = F.kl_div(log_q, q, reduction="none").sum(1)
        loss = loss + lambda_tr * (kl * w).sum()
    return loss


def refine_head(
    head: nn.Module,
    P: Tensor,
    labels: Tensor,
    q_cli: Tensor | None,
    known: Tensor | Sequence[int],
    kappa: int,
    gamma: float,
    lambda_lab: float = 1.0,
    lambda_tr: float = 1.0,
    steps: int = 5,
    lr: float = 0.01,
) -> dict[str, float]:
    """Eqs. (13)-(14): propagate ``P`` once on its graph, then :func:`sgd_refine` the head in
    place; ``{"loss_before", "loss_after"}`` (NaN for an empty memory)."""
    if P.shape[0] == 0:
        return {"loss_before": float("nan"), "loss_after": float("nan")}
    params = [p for p in head.parameters() if p.requires_grad]
    ref = params[0] if params else next(head.parameters())
    P = P.detach().to(device=ref.device, dtype=ref.dtype)
    labels = labels.to(ref.device)
    P_tilde = propagate(P, prototype_graph(P, labels, kappa))

    def loss_fn() -> Tensor:
        return refinement_loss(head, P_tilde, labels, q_cli, known, lambda_lab, lambda_tr)

    return sgd_refine(loss_fn, params, gamma, steps, lr)


def sgd_refine(
    loss_fn: Callable[[], Tensor], params: list[Tensor], gamma: float, steps: int, lr: float
) -> dict[str, float]:
    """``steps`` in-place SGD steps on ``gamma * loss_fn()`` (``.grad`` untouched);
    ``{"loss_before", "loss_after"}`` of ``loss_fn``."""
    with torch.no_grad():
        before = float(loss_fn())
    if gamma == 0 or steps <= 0 or not params:
        return {"loss_before": before, "loss_after": before}
    for _ in range(steps):
        grads = torch.autograd.grad(gamma * loss_fn(), params)
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p.sub_(lr * g)
    with torch.no_grad():
        after = float(loss_fn())
    return {"loss_before": before, "loss_after": after}
