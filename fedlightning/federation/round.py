"""The one federated round: broadcast, the clients' fits on the runner, the ledger, aggregation.

Every schedule (:class:`~fedlightning.federation.loop.FederatedLoop`,
:class:`~fedlightning.federation.stages.ContinualLoop` and its stage-end exchange,
:class:`~fedlightning.federation.task_loop.TaskLoop`) calls :func:`federated_round`; whatever the
runner, every message is counted here, in client order, once the runner returns the updates."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fedlightning.errors import FedLightningError, TooFewClients
from fedlightning.federation.ledger import DOWN, UP, CommLedger
from fedlightning.federation.runners import ClientFailed, contiguous_shares
from fedlightning.messages import ClientUpdate, ServerBroadcast, prefixed
from fedlightning.server.validation import MessageSpec, Rejection, bounded_weights, screen, validate

log = logging.getLogger(__name__)

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
        kind: what a remote client runs (``fit``, ``stage_end``, ``task_fit``): a runner whose
            clients live elsewhere (Flower nodes) sends ``kind``, ``params`` and ``broadcast``.
        params: the plain values that work needs besides the broadcast (epochs, stage, ...).
        broadcast: the round's broadcast (set by :func:`federated_round`).
        uplink: the declaration every update of the round is checked against before
            aggregation (``None``: any fields, finite values; docs/security.md).
        downlink: the declaration the round's broadcast is checked against before any
            client sees it (``Algorithm.downlink``; ``None``: unchecked)."""

    one: FitOne | None = None
    share: FitShare | None = None
    kind: str = "fit"
    params: dict[str, Any] = field(default_factory=dict)
    broadcast: ServerBroadcast | None = None
    uplink: MessageSpec | None = None
    downlink: MessageSpec | None = None

    def __call__(self, client: Any) -> ClientUpdate | None:
        return self.one(client)


def stacked(runner: Any, clients: Sequence[Any], share: FitShare) -> FitOne:
    """A per-client fit from a fit of several clients at once: the first client the runner
    asks for fits this rank's whole contiguous share as one stack; the runner keeps its
    progress bar, fault injection, gathering and RNG hand-over."""
    mine = contiguous_shares(len(clients), runner.world.size)[runner.world.rank]
    fitted: dict[int, ClientUpdate] = {}
    failed: list[BaseException] = []

    def fit_client(client: Any) -> ClientUpdate:
        if failed:  # the share's fit failed once: each of its clients is dropped, no refit
            raise failed[0]
        if not fitted:
            try:
                fitted.update((u.client_id, u) for u in share(mine))
            except Exception as e:
                failed.append(e)
                raise
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
    min_clients: int = 1,
) -> list[ClientUpdate]:
    """One round: ``server.broadcast(round)`` to ``clients``, their fits on ``runner``, each
    update checked against the work's declared ``uplink`` (:func:`screen`), every kept
    message into ``ledger`` (fields named ``<prefix>/<field>`` when ``prefix`` is set, in
    ``scope``) and every dropped one into its rejections, then ``aggregate(round, updates)``
    (default ``server.aggregate``) on the kept ones.

    With ``server.secure`` (:class:`~fedlightning.server.secure_sum.SecureSum`) and the server's
    own aggregation, each fit returns its masked share, checked by shape and dtype only, and
    the server aggregates their sum alone (docs/security.md).

    A client whose fit failed, whose message breaks a rule, or that sent nothing where a
    message is required, is dropped with one log line; when fewer than ``min_clients``
    messages remain, :class:`TooFewClients` ends the run before aggregation.

    Returns the updates kept, in client order."""
    broadcast = server.broadcast(round)
    fit = work(broadcast)
    fit.broadcast = broadcast
    check_downlink(broadcast, fit.downlink)
    spec = fit.uplink
    if spec is not None and spec.reference is None:
        spec = replace(spec, reference=broadcast)
    if spec is not None and getattr(server, "weight_bounds", None):
        spec = bounded_weights(spec, server.weight_bounds)
    if fit.share is not None:
        fit.one = stacked(runner, clients, fit.share)
    secure = getattr(server, "secure", None) if aggregate is None else None
    down = prefixed(broadcast, prefix)

    def exchange(work: ClientWork, spec: MessageSpec | None, down: Any) -> list[ClientUpdate]:
        """The clients' part on the runner, each message checked, counted or dropped."""
        updates = runner.run_round(round, clients, work, desc=desc or f"round {round}")
        return _keep(
            round, clients, updates, spec, ledger, down, prefix, scope, runner, min_clients
        )

    if secure is None:
        sent = exchange(fit, spec, down)
        (aggregate or server.aggregate)(round, sent)
        _suspicious(round, server, ledger, scope, runner, aggregate is None)
        return sent
    peers, weights = [c.client_id for c in clients], None
    if secure.weighs(server):  # Eq. (28) needs every norm before a client weights its share
        first = exchange(secure.first_phase(fit), secure.clear_spec(spec), down)
        weights = secure.weights(first, server)
        peers = [k for k in peers if k in weights]
        down = {k: ServerBroadcast(round, scalars={"reliability": r}) for k, r in weights.items()}
    share_spec = secure.share_spec(spec, optional=weights is not None)
    sent = exchange(secure.client_side(fit, peers, weights), share_spec, down)
    secure.aggregate(round, sent, broadcast, peers, server.aggregate, weights)
    return sent


def check_downlink(broadcast: ServerBroadcast, spec: MessageSpec | None) -> None:
    """Stop the run, in one line, when the server's ``broadcast`` breaks the method's
    declared downlink ``spec`` (a field it did not declare, a missing or misshapen model
    field, a non-finite value): a bug of the method's server, caught before a client sees
    it."""
    if spec is None:
        return
    as_message = ClientUpdate(broadcast.round, broadcast.tensors, broadcast.scalars, client_id=-1)
    broken = validate(as_message, spec)
    if broken:
        raise FedLightningError(
            f"round {broadcast.round}: the server's broadcast breaks the method's downlink "
            f"declaration (Algorithm.downlink): `{broken[0]}`: {broken[1]}"
        )


def _suspicious(
    round: int, server: Any, ledger: CommLedger, scope: str, runner: Any, ours: bool
) -> None:
    """The clients the server's robust rule set aside this round into ``ledger`` (beside
    its rejections), one log line each."""
    rule = getattr(server, "robust", None)
    if not ours or rule is None or not rule.on:
        return
    flagged = list(getattr(server, "flagged", ()))
    ledger.suspect(round, flagged, scope)  # the default reports once it set one aside
    ledger.screened = ledger.screened or not rule.auto or bool(ledger.suspicious)
    for client, why in flagged if runner.world.is_main else ():
        log.warning("round %d: client %d suspicious: %s", round, client, why)


def _keep(
    round: int,
    clients: Sequence[Any],
    updates: Sequence[Any],
    spec: MessageSpec | None,
    ledger: CommLedger,
    down: Any,
    prefix: str,
    scope: str,
    runner: Any,
    min_clients: int,
) -> list[ClientUpdate]:
    """The updates the server keeps (:func:`screen`), in client order; every broadcast
    (``down``: one message, or client id -> message) and kept message into ``ledger``, every
    dropped one into its rejections with one log line; :class:`TooFewClients` when fewer
    than ``min_clients`` remain after a drop."""
    ids = [c.client_id for c in clients]
    arrived, dropped = [], []
    for i, (k, update) in enumerate(zip(ids, updates, strict=True)):
        if isinstance(update, ClientFailed):
            dropped.append(Rejection(round, k, "", f"fit failed: {update.reason}"))
        elif update is None and spec is not None and not spec.optional:
            dropped.append(Rejection(round, k, "", "sent no message"))
        elif update is not None:
            arrived.append((i, update))
    sent, rejected = screen(round, ids, arrived, spec)
    kept = {id(u) for u in sent}
    for k, update in zip(ids, updates, strict=True):  # in client order, as before checks
        message = down.get(k) if isinstance(down, dict) else down
        if message is not None:
            ledger.record(
                DOWN, k, prefixed(message, prefix) if isinstance(down, dict) else message, scope
            )
        if id(update) in kept:
            ledger.record(UP, k, prefixed(update, prefix), scope)
    refused = sorted([*dropped, *rejected], key=lambda r: ids.index(r.client))
    ledger.reject(refused, scope)
    where = f"[{' '.join(x for x in (scope, prefix) if x)}] " if scope or prefix else ""
    for r in refused if runner.world.is_main else ():
        log.warning("%s%s", where, r.line())
    if refused and len(sent) < min_clients:
        raise TooFewClients(
            f"round {round}{f' ({scope})' if scope else ''}: {len(sent)} of {len(ids)} "
            f"clients' messages kept, fewer than federation.min_clients={min_clients} "
            f"(dropped: {'; '.join(_why(r) for r in refused)[:400]})"
        )
    return sent


def _why(r: Rejection) -> str:
    return f"client {r.client}{f' `{r.field}`' if r.field else ''}: {r.rule}"
