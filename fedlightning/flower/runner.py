"""``runner=flower``: each round's clients run on Flower nodes, one node per client; the
schedule, server step, ledger and checkpoints stay in the ServerApp (docs/scaling.md)."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from omegaconf import DictConfig, OmegaConf

from fedlightning.errors import ConfigError, FedLightningError
from fedlightning.federation.runners import ClientFailed, FitFn, Runner, client_timeout
from fedlightning.federation.world import World
from fedlightning.flower.records import (
    COUNTS,
    TASK,
    TENSORS,
    message_records,
    records_update,
    tensor_record,
)
from fedlightning.messages import ClientUpdate
from fedlightning.server.aggregate import as_model_fields

log = logging.getLogger(__name__)
POLL_S = 0.25  # between two pulls of replies from the SuperLink


class NodeLost(FedLightningError):
    """Flower nodes could not be set up, or a node did not answer an evaluation within
    ``runner.client_timeout_s`` (a node that fails a fit only drops its client from the
    round: :class:`~fedlightning.federation.runners.ClientFailed`)."""


def run_clients(cfg: DictConfig) -> int:
    """How many clients (one Flower node each) the run has: ``federation.clients``, or for
    FedTIP's task protocol the clients that own the stream (``protocol.ownership.clients``)."""
    if str(cfg.get("task")) == "temporal":
        return int(cfg.protocol.ownership.clients)
    return int(cfg.federation.clients)


class FlowerRunner(Runner):
    """Sends each round's clients to their Flower nodes through the ``grid`` of the
    ServerApp that builds it (the config alone cannot).

    Args:
        executor: the local-fit executor; the nodes build their own from ``runner.executor``.
        client_timeout_s: seconds to wait for the replies of one exchange: a client whose
            node has not answered a fit by then, or answered with an error, is dropped from
            the round (:class:`ClientFailed`); a missing evaluation is :class:`NodeLost`.
        timeout_s: the old name of ``client_timeout_s`` (read, with a warning).
        connect_timeout_s: seconds to wait for one node per client to answer the set-up.
        client_cpus: Flower simulation only: CPUs per virtual node.
        progress: as every runner's; a Flower round shows in the log, with no bar."""

    name = "flower"

    def __init__(
        self,
        executor: Any,
        grid: Any = None,
        client_timeout_s: float = 600.0,
        connect_timeout_s: float = 300.0,
        client_cpus: float = 1,
        progress: bool = True,
        timeout_s: float | None = None,
    ) -> None:
        if grid is None:
            raise ConfigError(
                "runner",
                "runner=flower runs inside a Flower ServerApp: start it with "
                "`fedlightning flower-sim ...` or `flwr run tools/flower ...` (docs/scaling.md)",
            )
        self.timeout_s = client_timeout(client_timeout_s, timeout_s) or 600.0
        if float(connect_timeout_s) <= 0:
            raise ConfigError("runner.connect_timeout_s", "must be > 0 seconds")
        self.executor, self.grid, self.world = executor, grid, World()
        self.connect_timeout_s = float(connect_timeout_s)
        self.nodes: dict[int, int] = {}  # client id -> Flower node id
        self.run_dir: Path | None = None
        self.key = ""

    # ------------------------------------------------------------------ set-up
    def begin(self, cfg: DictConfig, run_dir: Path, hashes: dict[str, str]) -> None:
        """Find one node per client and hand each the run's config (``query`` exchange)."""
        self.run_dir = Path(run_dir)
        # the run's name on the nodes: a hash of its directory, the same when it resumes
        self.key = hashlib.sha256(str(self.run_dir.resolve()).encode()).hexdigest()[:16]
        num_clients = run_clients(cfg)
        deadline = time.monotonic() + self.connect_timeout_s
        node_ids = self._wait_for_nodes(num_clients, deadline)
        task = {
            **self._task(0),
            "config": OmegaConf.to_yaml(cfg, resolve=True),
            "hashes": json.dumps(hashes, sort_keys=True),
            "clients": num_clients,
        }
        messages = [
            Message(RecordDict({TASK: ConfigRecord(task)}), dst_node_id=n, message_type="query")
            for n in node_ids
        ]
        claims: dict[int, int] = {}

        def all_claimed(replies: list[Message]) -> bool:
            for r in replies:
                if not r.has_error():
                    claims.setdefault(int(r.content[TASK]["client"]), r.metadata.src_node_id)
            return len(claims) == num_clients

        replies = self._collect(messages, all_claimed, deadline)
        missing = sorted(set(range(num_clients)) - set(claims))
        if missing:  # a node that is gone answers with an error; another may hold its client
            errors = sorted({r.error.reason for r in replies if r.has_error()})
            raise NodeLost(
                f"setting up the Flower nodes: no node set up client(s) {missing} within "
                f"runner.connect_timeout_s={self.connect_timeout_s:g} s; start one SuperNode "
                f"per client with --node-config 'partition-id=K' (K = 0..{num_clients - 1})"
                + (f"; nodes failed with: {'; '.join(errors)}" if errors else "")
            )
        self.nodes = {k: claims[k] for k in range(num_clients)}
        log.info("%d Flower nodes set up for run %s", num_clients, self.key)

    def _wait_for_nodes(self, n: int, deadline: float) -> list[int]:
        while True:
            ids = sorted(self.grid.get_node_ids())
            if len(ids) >= n:
                return ids
            if time.monotonic() > deadline:
                raise NodeLost(
                    f"only {len(ids)} of {n} Flower nodes connected within "
                    f"runner.connect_timeout_s={self.connect_timeout_s:g} s; start one "
                    "SuperNode per client"
                )
            time.sleep(POLL_S)

    # ------------------------------------------------------------------ a round
    def run_round(
        self, round: int, clients: Sequence[Any], fit: FitFn, desc: str = ""
    ) -> list[ClientUpdate | ClientFailed | None]:
        """Send ``fit``'s broadcast, kind and parameters to each client's node; return
        their updates (``None``: no message; :class:`ClientFailed`: the node answered with
        an error, a malformed reply, or not within ``client_timeout_s``) in order."""
        task = {**self._task(round), "kind": fit.kind, **fit.params}
        contents = {
            c.client_id: message_records(
                fit.broadcast, {**task, "client": c.client_id, "position": i}
            )
            for i, c in enumerate(clients)
        }
        replies, problems = self._exchange(MessageType.TRAIN, round, contents)
        out: list[ClientUpdate | ClientFailed | None] = []
        for c in clients:
            k = c.client_id
            if k in problems:
                out.append(ClientFailed(k, problems[k]))
                continue
            try:
                out.append(records_update(replies[k].content, round, k))
            except ValueError as e:
                out.append(ClientFailed(k, f"malformed reply: {e}"))
        return out

    def evaluate(
        self, round: int, clients: Sequence[Any], evaluate: Callable[[Any], dict[str, int]]
    ) -> dict[int, dict[str, int]]:
        """Send the global model to every client's node; return their counts."""
        fields, task = as_model_fields(evaluate.global_state), self._task(round)
        contents = {}
        for c in clients:
            ask = ConfigRecord({**task, "client": c.client_id})
            contents[c.client_id] = RecordDict({TENSORS: tensor_record(fields), TASK: ask})
        replies, problems = self._exchange(MessageType.EVALUATE, round, contents)
        if problems:
            raise NodeLost(
                f"round {round} (evaluate): "
                + "; ".join(f"client {k}: {why}" for k, why in sorted(problems.items()))
                + ". The run is checkpointed after its last finished round; once the "
                "SuperNode(s) run again, resume it: flwr run tools/flower <connection> "
                f"--run-config 'resume=\"{self.run_dir}\"' (or: fedlightning flower-sim "
                f"resume={self.run_dir})"
            )
        return {k: {n: int(v) for n, v in replies[k].content[COUNTS].items()} for k in contents}

    # ------------------------------------------------------------------ exchanges
    def _task(self, round: int) -> dict[str, Any]:
        """What every message tells its node: the run, the round, and the intra-op threads
        of this process (the same blocking of matrix products, so bitwise the same fits)."""
        return {"run": self.key, "round": round, "threads": torch.get_num_threads()}

    def _exchange(
        self, kind: str, round: int, contents: Mapping[int, RecordDict]
    ) -> tuple[dict[int, Message], dict[int, str]]:
        """Send ``contents[client]`` to each client's node; the good replies and what went
        wrong with the others (an error reply, or none in time), by client."""
        messages = [
            Message(content, dst_node_id=self.nodes[k], message_type=kind, group_id=str(round))
            for k, content in contents.items()
        ]
        want = len(messages)
        replies = self._collect(
            messages, lambda got: len(got) == want, time.monotonic() + self.timeout_s
        )
        # by the message replied to (its id is set by the push): the SuperLink answers for
        # a node it knows is gone ("Node Unavailable") from its own node id, not the node's
        by_message = {m.metadata.message_id: k for m, k in zip(messages, contents, strict=True)}
        out = {by_message[r.metadata.reply_to_message_id]: r for r in replies}
        problems = {k: f"node error: {r.error.reason}" for k, r in out.items() if r.has_error()}
        for k in sorted(set(contents) - set(out)):
            problems[k] = f"no reply within runner.client_timeout_s={self.timeout_s:g} s"
        return {k: r for k, r in out.items() if k not in problems}, problems

    def _collect(
        self, messages: list[Message], done: Callable[[list[Message]], bool], deadline: float
    ) -> list[Message]:
        """Push ``messages``; pull replies until ``done(replies)`` or the deadline."""
        pending = set(self.grid.push_messages(messages))
        replies: list[Message] = []
        while pending:
            got = list(self.grid.pull_messages(pending))
            replies += got
            pending -= {r.metadata.reply_to_message_id for r in got}
            if done(replies) or time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        return replies
