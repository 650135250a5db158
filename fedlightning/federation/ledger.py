"""The communication ledger: every value that crosses the client/server boundary."""

from __future__ import annotations

import pickle
from collections import defaultdict
from typing import Any

from fedlightning.messages import Message
from fedlightning.server.validation import Rejection

UP, DOWN = "up", "down"
MIB = 1024**2
COLUMNS = ("direction", "round", "client", "field", "values", "bytes", "scope")


def counted(records: list[tuple], names: tuple[str, ...], key: str) -> dict[str, Any]:
    """The count of ``(round, client, ...)`` records, per client and per round, and every
    record under ``key`` as a mapping of ``names``."""
    per_client, per_round = defaultdict(int), defaultdict(int)
    for r, c, *_ in records:
        per_client[c] += 1
        per_round[r] += 1
    return {
        "count": len(records),
        "per_client": {str(k): v for k, v in sorted(per_client.items())},
        "per_round": {str(k): v for k, v in sorted(per_round.items())},
        key: [dict(zip(names, e, strict=True)) for e in records],
    }


class CommLedger:
    """Counts transmitted values and bytes per direction, round, client and named field.

    Every message goes through :meth:`record`; totals are derived from one list of
    entries ``(direction, round, client, field, values, bytes, scope)``, so no count can
    drift from another. ``scope`` names the schedule step a round belongs to where rounds
    restart (FedTIP's ``task=<id>``); it is empty for a run whose rounds never restart."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, int, int, str, int, int, str]] = []
        self._totals = {UP: 0, DOWN: 0}  # running totals: per-round logging stays O(1)
        # messages the server dropped: (round, client, field, rule, values, scope)
        self.rejections: list[tuple[int, int, str, str, int, str]] = []
        # clients a robust rule set aside (kept messages): (round, client, rule, scope)
        self.suspicious: list[tuple[int, int, str, str]] = []
        self.screened = False  # a robust rule runs: the summary reports ``suspicious``
        self._packed: list[bytes] = []  # entries[:_packed_upto], pickled chunk by chunk
        self._packed_upto = 0

    def reject(self, rejections: list[Rejection], scope: str = "") -> None:
        """Record messages the server dropped (not counted as communication: they carried
        nothing the protocol used), and clients dropped from a round as a whole."""
        for r in rejections:
            self.rejections.append((r.round, r.client, r.field, r.rule, r.values, scope))

    def rejected(self, *, round: int | None = None, scope: str | None = None) -> int:
        """How many messages (or clients) were dropped, optionally in one round / scope."""
        return sum(
            1
            for r, _, _, _, _, sc in self.rejections
            if (round is None or r == round) and (scope is None or sc == scope)
        )

    def suspect(self, round: int, flagged: list[tuple[int, str]], scope: str = "") -> None:
        """Record the clients a robust rule set aside this round (their messages passed the
        screen and were counted; the rule kept them out of the model)."""
        self.suspicious.extend((round, c, why, scope) for c, why in flagged)

    def suspected(self, *, round: int | None = None) -> int:
        """How many clients a robust rule set aside, optionally in one round."""
        return sum(1 for r, *_ in self.suspicious if round is None or r == round)

    def suspicious_summary(self) -> dict[str, Any]:
        """The ``comm.suspicious`` block (:func:`counted`; records: round, client, rule, scope)."""
        return counted(self.suspicious, ("round", "client", "rule", "scope"), "clients")

    def rejected_summary(self) -> dict[str, Any]:
        """The ``comm.rejected`` block (:func:`counted`; records: round, client, field, rule,
        values, scope)."""
        names = ("round", "client", "field", "rule", "values", "scope")
        return counted(self.rejections, names, "messages")

    def record(self, direction: str, client_id: int, message: Message, scope: str = "") -> None:
        """Count ``message`` sent in ``direction`` (``"up"`` or ``"down"``) to/from a client."""
        check_direction(direction)
        for name, (values, nbytes) in message.field_sizes().items():
            self.entries.append((direction, message.round, client_id, name, values, nbytes, scope))
            self._totals[direction] += values

    def record_values(
        self, direction: str, client_id: int, name: str, values: int, scope: str = ""
    ) -> None:
        """Count ``values`` float32 values of one field that is not a :class:`Message`
        (the bank a client is provisioned with, say), at round 0."""
        check_direction(direction)
        self.entries.append((direction, 0, client_id, name, values, 4 * values, scope))
        self._totals[direction] += values

    def total(
        self,
        direction: str,
        *,
        round: int | None = None,
        client: int | None = None,
        scope: str | None = None,
    ) -> int:
        """Values sent in ``direction``, optionally only in one round / for one client / in
        one scope."""
        if round is None and client is None and scope is None:
            return self._totals[direction]
        return sum(
            v
            for d, r, c, _, v, _, sc in self.entries
            if d == direction
            and (round is None or r == round)
            and (client is None or c == client)
            and (scope is None or sc == scope)
        )

    def total_bytes(self, direction: str) -> int:
        return sum(e[5] for e in self.entries if e[0] == direction)

    def mib(self, direction: str, **kw: Any) -> float:
        """:meth:`total` as float32 MiB: ``4 * values / 1024^2`` (FedTIP Eq. (32))."""
        return 4.0 * self.total(direction, **kw) / MIB

    def by(self, column: str) -> dict[str, dict[str, int]]:
        """``str(key) -> {"up": values, "down": values}`` per key of an entry's ``column``
        (``round``, ``client``, ``field`` or ``scope``), in key order."""
        i = COLUMNS.index(column)
        out: dict[Any, dict[str, int]] = defaultdict(lambda: {UP: 0, DOWN: 0})
        for e in self.entries:
            out[e[i]][e[0]] += e[4]
        return {str(k): v for k, v in sorted(out.items())}

    def summary(self) -> dict[str, Any]:
        """The ``comm`` block of ``summary.json``."""
        return {
            "uplink_mib": self.mib(UP),
            "downlink_mib": self.mib(DOWN),
            "uplink_values": self.total(UP),
            "downlink_values": self.total(DOWN),
            "uplink_bytes": self.total_bytes(UP),
            "downlink_bytes": self.total_bytes(DOWN),
            "fields": self.by("field"),
            "per_client": self.by("client"),
            "per_round": self.by("round"),
            "rejected": self.rejected_summary(),
            **({"suspicious": self.suspicious_summary()} if self.screened else {}),
        }

    def message_values(self, prefix: str = "") -> dict[int, int]:
        """Client -> values of its latest uplink message (fields ``<prefix>...``)."""
        last: dict[int, tuple[str, int]] = {}
        sizes: dict[tuple[int, str, int], int] = defaultdict(int)
        for d, r, c, name, v, _, sc in self.entries:
            if d == UP and r > 0 and name.startswith(prefix):
                sizes[(c, sc, r)] += v
                last[c] = (sc, r)
        return {c: sizes[(c, *key)] for c, key in sorted(last.items())}

    def state_dict(self) -> dict[str, Any]:
        """The entries as pickled chunks (``packed``), each holding the entries recorded
        since the previous call: a checkpoint after every round pickles only that round's
        entries, not every earlier round's again (docs/scaling.md)."""
        if len(self.entries) < self._packed_upto:  # entries replaced: pack them anew
            self._packed, self._packed_upto = [], 0
        if len(self.entries) > self._packed_upto:
            self._packed.append(pickle.dumps(self.entries[self._packed_upto :], protocol=5))
            self._packed_upto = len(self.entries)
        state = {"packed": list(self._packed), "rejections": list(self.rejections)}
        if self.screened:
            state["suspicious"] = list(self.suspicious)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Read :meth:`state_dict`, or an older checkpoint's ``entries`` (a list of tuples,
        the oldest without ``scope``)."""
        self.entries, self.rejections, self.suspicious = [], [], []
        self._packed, self._packed_upto = [], 0
        self._totals = {UP: 0, DOWN: 0}
        self.extend(state)

    def extend(self, state: dict[str, Any]) -> None:
        """Append the records of a saved ledger state (:meth:`state_dict`) after these, as
        recording them here would have (a task run in another process, say)."""
        more = unpacked(state)
        self.entries.extend(more["entries"])
        self.rejections.extend(more["rejections"])
        self.suspicious.extend(tuple(e) for e in state.get("suspicious", []))
        for d, _, _, _, v, *_ in more["entries"]:
            self._totals[d] += v


def unpacked(state: dict[str, Any]) -> dict[str, list[tuple]]:
    """A saved ledger state (:meth:`CommLedger.state_dict`, or an older checkpoint's
    ``entries``) as ``{"entries": [...], "rejections": [...]}``, every entry with its
    ``scope``: two runs' ledgers compare equal this way however their chunks fell."""
    if "packed" in state:
        entries = [e for chunk in state["packed"] for e in pickle.loads(chunk)]
    else:
        entries = state["entries"]
    return {
        "entries": [(*e, "")[:7] for e in entries],  # the oldest entries had no scope
        "rejections": [tuple(e) for e in state.get("rejections", [])],
    }


def check_direction(direction: str) -> None:
    if direction not in (UP, DOWN):
        raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
