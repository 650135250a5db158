"""Server-averaged class prototypes written into the global model's buffers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from fedlightning.messages import ClientUpdate
from fedlightning.server.server import ServerModule


def class_mean(prototypes: Sequence[Tensor], counts: Sequence[float]) -> Tensor:
    """The count-weighted mean of the clients' prototypes of a class."""
    w = torch.tensor([float(n) for n in counts], dtype=torch.float64)
    stacked = torch.stack([p.double() for p in prototypes])
    mean = (w.view(-1, *[1] * (stacked.dim() - 1)) * stacked).sum(0) / w.sum()
    return mean.to(prototypes[0].dtype)


def read_class_fields(
    update: ClientUpdate, prefix: str, count_prefix: str
) -> list[tuple[int, Tensor, float]]:
    """``(class, prototype, count)`` of a message's ``<prefix><c>`` fields, by class."""
    out = []
    for key, p in update.tensors.items():
        rest = key[len(prefix) :]
        if key.startswith(prefix) and rest.isdigit():
            out.append((int(rest), p, update.scalars[count_prefix + rest]))
    return sorted(out, key=lambda x: x[0])


class ClassBank(ServerModule):
    """Per class the latest round's :func:`class_mean`, written as ``buffer`` and ``seen``."""

    def __init__(self, template: Tensor, buffer: str, seen: str, prefix: str, count_prefix: str):
        self.template = torch.zeros_like(template)
        self.buffer, self.seen = buffer, seen
        self.prefix, self.count_prefix = prefix, count_prefix
        self.means: dict[int, Tensor] = {}

    def aggregate(self, round: int, updates: Sequence[ClientUpdate]) -> None:
        sent: dict[int, list[tuple[Tensor, float]]] = {}
        for u in updates:
            for c, p, n in read_class_fields(u, self.prefix, self.count_prefix):
                sent.setdefault(c, []).append((p, n))
        for c, items in sorted(sent.items()):
            self.means[c] = class_mean([p for p, _ in items], [n for _, n in items])

    def update_global(self, round: int, state: dict[str, Tensor]) -> dict[str, Tensor]:
        bank, seen = self.template.clone(), torch.zeros(self.template.size(0))
        for c, p in self.means.items():
            bank[c], seen[c] = p, 1.0
        return {**state, self.buffer: bank, self.seen: seen}

    def state_dict(self) -> dict[str, Any]:
        return {"means": dict(self.means)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.means = dict(state["means"])


def class_means(x: Tensor, y: Tensor, mask: Tensor) -> dict[int, tuple[Tensor, int]]:
    """Each class's mean of ``x`` over the nodes ``mask`` selects, with its support."""
    out = {}
    for c in torch.unique(y[mask]).tolist():
        sel = mask & (y == c)
        out[int(c)] = (x[sel].mean(0), int(sel.sum()))
    return out
