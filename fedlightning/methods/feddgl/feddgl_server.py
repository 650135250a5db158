"""FedDGL's server (Xie et al., ACML 2024; docs/fedtip.md, "FedDGL"): FedAvg, FedTGP's
prototype generator fitted with an adaptive margin, each client's personalisation weight
from its prototypes' cosine with the global ones (guarded for single-class clients)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedlightning.messages import ClientUpdate, ServerBroadcast
from fedlightning.server.aggregate import strip_prefix
from fedlightning.server.reliability import FedTIPServer

GLOB = "glob."  # broadcast: the generated global prototype of a class
MIX = "mix."  # broadcast: a client's personalisation weight


def adaptive_margin(class_means: Mapping[int, Tensor], cap: float = 100.0) -> float:
    """FedTGP's margin: the largest gap of the class means, capped; 0 below two classes."""
    qs = list(class_means.values())
    if len(qs) < 2:
        return 0.0
    gaps = [float((a - b).norm()) for i, a in enumerate(qs) for b in qs[i + 1 :]]
    return min(max(gaps), cap)


def generator_loss(q: Tensor, y: Tensor, glob: Tensor, margin: float) -> Tensor:
    """Cross-entropy over negative distances to ``glob``, the true class's raised by ``margin``."""
    logits = -torch.cdist(q, glob)
    logits = logits - margin * F.one_hot(y, glob.size(0)).to(logits.dtype)
    return F.cross_entropy(logits, y)


def mixing_weights(
    client_protos: Sequence[Mapping[int, Tensor]], glob: Mapping[int, Tensor], temp: float = 0.5
) -> list[float]:
    """The softmax over clients of ``temp`` times the cosine of each client's concatenated
    prototypes with the global ones of the same classes (0 without any)."""
    cos = []
    for protos in client_protos:
        shared = sorted(c for c in protos if c in glob)
        if not shared:
            cos.append(0.0)
            continue
        a = torch.cat([protos[c].double() for c in shared])
        b = torch.cat([glob[c].double() for c in shared])
        cos.append(float(F.cosine_similarity(a, b, dim=0)))
    w = torch.tensor(cos, dtype=torch.float64).mul(temp).softmax(0)
    return w.tolist()


def personalise(glob: Tensor, own: Tensor, w: float) -> Tensor:
    """``(1 - w) glob + w own``."""
    return (1 - w) * glob + w * own


class PrototypeGenerator(nn.Module):
    """FedTGP's generator: a learned embedding per class through a two-layer MLP."""

    def __init__(self, classes: int, d: int, hidden: int = 256) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(classes, d))
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, d))

    def forward(self) -> Tensor:
        return self.mlp(self.embed)


class FedDGLServer:
    """One task's FedDGL server (module docstring); ``d``: the prototypes' width."""

    def __init__(
        self,
        omega: Mapping[str, Tensor],
        d: int,
        classes: Sequence[int] = (0, 1),
        margin_cap: float = 100.0,
        gen_lr: float = 0.05,
        gen_steps: int = 20,
        temp: float = 0.5,
    ) -> None:
        self.fedavg = FedTIPServer(
            omega, eta_s=1.0, reliability_weights=False, anchors=False, field="model"
        )
        self.classes = tuple(classes)
        self.generator = PrototypeGenerator(len(self.classes), d)
        self.margin_cap, self.gen_lr, self.gen_steps, self.temp = (
            margin_cap,
            gen_lr,
            gen_steps,
            temp,
        )
        self.trained = False
        self.mix: dict[int, float] = {}
        self.margin = 0.0

    def state(self) -> dict[str, Tensor]:
        return self.fedavg.state()

    def global_prototypes(self) -> dict[int, Tensor]:
        """The generated prototypes, once the generator was trained (else none)."""
        if not self.trained:
            return {}
        with torch.no_grad():
            g = self.generator()
        return {c: g[i].clone() for i, c in enumerate(self.classes)}

    def broadcast(self, round: int) -> ServerBroadcast:
        """The FedAvg model, the global prototypes and each client's weight."""
        b = self.fedavg.broadcast(round)
        tensors = {**b.tensors, **{f"{GLOB}{c}": q for c, q in self.global_prototypes().items()}}
        scalars = {f"{MIX}{k}": w for k, w in self.mix.items()}
        return ServerBroadcast(round=round, tensors=tensors, scalars=scalars)

    def fit_generator(self, protos: Sequence[Mapping[int, Tensor]]) -> None:
        """``gen_steps`` SGD steps of :func:`generator_loss` (none below two classes)."""
        rows = [(c, q) for p in protos for c, q in sorted(p.items())]
        present = sorted({c for c, _ in rows})
        means = {c: torch.stack([q for cc, q in rows if cc == c]).mean(0) for c in present}
        self.margin = adaptive_margin(means, self.margin_cap)
        if len(present) < 2:
            return
        index = {c: i for i, c in enumerate(self.classes)}
        q = torch.stack([q.float() for _, q in rows])
        y = torch.tensor([index[c] for c, _ in rows])
        opt = torch.optim.SGD(self.generator.parameters(), lr=self.gen_lr)
        for _ in range(self.gen_steps):
            opt.zero_grad()
            generator_loss(q, y, self.generator(), self.margin).backward()
            opt.step()
        self.trained = True

    def aggregate(self, round: int, updates: Sequence[ClientUpdate]) -> None:
        """FedAvg, the generator's fit, then each client's weight for the next round."""
        self.fedavg.aggregate(round, updates)
        protos = [
            {int(c): v for c, v in strip_prefix(u.tensors, "proto.").items()} for u in updates
        ]
        self.fit_generator(protos)
        glob = self.global_prototypes()
        weights = mixing_weights(protos, glob, self.temp) if glob else [0.0] * len(updates)
        self.mix = {u.client_id: w for u, w in zip(updates, weights, strict=True)}

    def class_prototypes(self) -> dict[int, Tensor]:
        """The generated prototypes (the uploads' mean while the generator is untrained)."""
        return self.global_prototypes() or self.fedavg.class_prototypes()
