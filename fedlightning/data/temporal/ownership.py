r"""Who owns which events: a user-to-client map (FedTIP Sec. 3.2, 5.1.1).

Every event belongs to the client that owns its source-side node (its user):
:math:`\pi(e) = \pi_U(u)`. Three maps of users to :math:`K` clients:

- ``user_iid``: a seeded permutation of the users cut into :math:`K` near-equal parts
  (sizes differ by at most one);
- ``label_skew``: users with a positive state label in the supervised pool and users
  without are spread by two independent :math:`\mathrm{Dirichlet}(\alpha \mathbf{1}_K)`
  client distributions, so some clients see mostly one label type;
- ``activity_skew``: users go to client :math:`k` with probability proportional to
  :math:`(k + 1)^{-s}` (client order seeded), so client activity is uneven.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fedlightning.data.temporal.events import EventStream
from fedlightning.utils.io import content_hash
from fedlightning.utils.seeding import derive_seed

KINDS = ("user_iid", "label_skew", "activity_skew")


@dataclass
class Ownership:
    """``owner[user]`` for every source-side node (``-1`` for nodes that are not users)."""

    owner: np.ndarray
    clients: int
    params: dict[str, Any]

    def of_events(self, stream: EventStream) -> np.ndarray:
        """The owning client of every event ``[E]``."""
        return self.owner[stream.src]

    def to_json(self) -> dict[str, Any]:
        return {"params": self.params, "clients": self.clients, "owner": self.owner.tolist()}

    @property
    def hash(self) -> str:
        return content_hash(self.to_json())


def build_ownership(
    stream: EventStream,
    sup_pool: np.ndarray,
    kind: str = "user_iid",
    clients: int = 10,
    seed: int = 2026,
    alpha: float = 0.5,
    skew: float = 1.0,
) -> Ownership:
    """Map users to ``clients`` by ``kind`` (module docstring).

    Args:
        stream: the events.
        sup_pool: indices of the supervised-pool events (``label_skew`` reads their labels).
        kind: ``user_iid``, ``label_skew`` or ``activity_skew`` (default ``user_iid``).
        clients: :math:`K` (default ``10``).
        seed: ``protocol.seed``.
        alpha: Dirichlet concentration of ``label_skew`` (default ``0.5``).
        skew: exponent :math:`s` of ``activity_skew`` (default ``1.0``).
    """
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
