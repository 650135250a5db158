"""The one federated round: broadcast, the clients' fits on the runner, the ledger, aggregation.

Every schedule (:class:`~fedlightning.federation.loop.FederatedLoop`,
:class:`~fedlightning.federation.stages.ContinualLoop` and its stage-end exchange,
:class:`~fedlightning.federation.tasks.TaskLoop`) calls :func:`federated_round`; whatever the
runner, every message is counted here, in client order, once the runner returns the updates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedlightning.federation.ledger import DOWN, UP, CommLedger
from fedlightning.federation.runners import contiguous_shares
from fedlightning.messages import ClientUpdate, ServerBroadcast, prefixed

FitOne = Callable[[Any], ClientUpdate | None]
FitShare = Callable[[range], list[ClientUpdate]]


@dataclass
class ClientWork:
    """What the clients of a round do with the broadcast; the per-client fit a runner calls.

    Attributes:
        one: one client's fit (``client -> update``, or ``None`` for no message).
        share: the fit of several clients at once (stacked execution): ``positions ->
            updates`` for the clients at those positions of the round, in order; ``None``:
            the clients fit one at a time through ``one``.
        kind: what a remote client runs (``fit``, ``stage_end``, ``task_fit``): a runner
            whose clients live elsewhere (Flower nodes) sends ``kind``, ``params`` and
            ``broadcast``, and the node does the same work on its own copy of the client.
        params: the plain values that work needs besides the broadcast (epochs, stage, ...).
        broadcast: the round's broadcast (set by :func:`federated_round`).
    """

    one: FitOne | None = None
    share: FitShare | None = None
    kind: str = "fit"
    params: dict[str, Any] = field(default_factory=dict)
    broadcast: ServerBroadcast | None = None

    def __call__(self, client: Any) -> ClientUpdate | None:
        return self.one(client)


def stacked(runner: Any, clients: Sequence[Any], share: FitShare) -> FitOne:
    """A per-client fit from a fit of several clients at once: the first client the runner
    asks for fits this rank's whole contiguous share as one stack; the runner keeps its
    progress bar, fault injection, gathering and RNG hand-over."""
    mine = contiguous_shares(len(clients), runner.world.size)[runner.world.rank]
    fitted: dict[int, ClientUpdate] = {}

    def fit_client(client: Any) -> ClientUpdate:
        if not fitted:
            fitted.update((u.client_id, u) for u in share(mine))
        if client.client_id not in fitted:
            raise RuntimeError(f"client {client.client_id} is not in this rank's share")
        return fitted[client.client_id]

    return fit_client


def federated_round(
    round: int,
    server: Any,
    runner: Any,
    clients: Sequence[Any],
    work: Callable[[ServerBroadcast], ClientWork],
    ledger: CommLedger,
    *,
    aggregate: Callable[[int, list[ClientUpdate]], None] | None = None,
    prefix: str = "",
    scope: str = "",
    desc: str = "",
) -> list[ClientUpdate]:
    """One round: ``server.broadcast(round)`` to ``clients``, their fits on ``runner``, every
    message into ``ledger`` (fields named ``<prefix>/<field>`` when ``prefix`` is set, in
    ``scope``), then ``aggregate(round, updates)`` (default ``server.aggregate``).

    With ``server.secure`` (a :class:`~fedlightning.server.secure_sum.SecureSum`, set by
    ``federation.secure_sum``) and the server's own aggregation, each client's fit returns its
    masked share, and the server aggregates their sum alone (docs/security.md).

    Returns the updates sent, in client order (a client that sends nothing is left out).
    """
    broadcast = server.broadcast(round)
    fit = work(broadcast)
    fit.broadcast = broadcast
    if fit.share is not None:
        fit.one = stacked(runner, clients, fit.share)
    secure = getattr(server, "secure", None) if aggregate is None else None
    peers = [c.client_id for c in clients]
    if secure is not None:
        fit = secure.client_side(fit, peers)
    updates = runner.run_round(round, clients, fit, desc=desc or f"round {round}")
    down = prefixed(broadcast, prefix)
    sent = []
    for client, update in zip(clients, updates, strict=True):
        ledger.record(DOWN, client.client_id, down, scope)
        if update is not None:
            ledger.record(UP, client.client_id, prefixed(update, prefix), scope)
            sent.append(update)
    if secure is not None:
        secure.aggregate(round, sent, broadcast, peers, server.aggregate)
    else:
        (aggregate or server.aggregate)(round, sent)
    return sent
