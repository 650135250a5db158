r"""Who owns which events (FedTIP Sec. 3.2, 5.1.1): every event belongs to the client that
owns its source-side node (its user), :math:`\pi(e) = \pi_U(u)`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fedlightning.data.temporal.events import EventStream
from fedlightning.utils.io import ContentHashed
from fedlightning.utils.seeding import derive_seed

KINDS = ("user_iid", "label_skew", "activity_skew")


@dataclass
class Ownership(ContentHashed):
    """``owner[user]`` for every source-side node (``-1`` for nodes that are not users)."""

    owner: np.ndarray
    clients: int
    params: dict[str, Any]

    def of_events(self, stream: EventStream) -> np.ndarray:
        """The owning client of every event ``[E]``."""
        return self.owner[stream.src]

    def to_json(self) -> dict[str, Any]:
        return {"params": self.params, "clients": self.clients, "owner": self.owner.tolist()}


def build_ownership(
    stream: EventStream,
    sup_pool: np.ndarray,
    kind: str = "user_iid",
    clients: int = 10,
    seed: int = 2026,
    alpha: float = 0.5,
    skew: float = 1.0,
) -> Ownership:
    r"""Map the users to :math:`K` = ``clients`` clients, seeded by ``protocol.seed``:

    - ``user_iid``: a permutation of the users cut into :math:`K` near-equal parts;
    - ``label_skew``: users with a positive label among the supervised-pool events
      ``sup_pool`` and the others, spread by two independent
      :math:`\mathrm{Dirichlet}(\alpha \mathbf{1}_K)` client distributions;
    - ``activity_skew``: users go to client :math:`k` with probability proportional to
      :math:`(k + 1)^{-s}` (``skew`` :math:`s`; client order seeded)."""
    if kind not in KINDS:
        raise ValueError(f"protocol.ownership.kind must be one of {KINDS}, got {kind!r}")
    if clients < 1:
        raise ValueError(f"protocol.ownership.clients must be >= 1, got {clients}")
    users = stream.users
    rng = np.random.default_rng(derive_seed(seed, "ownership", kind))
    if kind == "user_iid":
        perm = rng.permutation(len(users))
        assign = np.empty(len(users), dtype=np.int64)
        for k, part in enumerate(np.array_split(perm, clients)):
            assign[part] = k
    elif kind == "label_skew":
        if stream.label is None:
            raise ValueError("protocol.ownership.kind=label_skew needs a stream with labels")
        positive = np.isin(users, stream.src[sup_pool][stream.label[sup_pool] == 1])
        assign = np.empty(len(users), dtype=np.int64)
        for group in (positive, ~positive):
            p = rng.dirichlet(np.full(clients, alpha))
            assign[group] = rng.choice(clients, size=int(group.sum()), p=p)
    else:
        order = rng.permutation(clients)
        p = (np.arange(clients) + 1.0) ** (-skew)
        assign = order[rng.choice(clients, size=len(users), p=p / p.sum())]
    owner = np.full(stream.num_nodes, -1, dtype=np.int64)
    owner[users] = assign
    params = {"kind": kind, "clients": clients, "seed": int(seed), "alpha": alpha, "skew": skew}
    return Ownership(owner, clients, params)
