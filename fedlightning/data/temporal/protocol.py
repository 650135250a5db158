"""The FedTIP protocol objects, materialized together: manifest, ownership, tasks, negatives
and, with ``protocol.noise`` on, the unreliable clients' label noise.

Built from ``protocol.*`` (``conf/protocol/temporal.yaml``) and the stream, cached under
``protocol.cache_dir`` by a hash of the stream's content and every parameter, reused when
both are the same, and written into the run directory as JSON with their hashes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from fedlightning.data.temporal.events import EventStream
from fedlightning.data.temporal.manifest import (
    DOWN_VAL,
    SUP_POOL,
    TEST,
    Manifest,
    build_manifest,
    manifest_table,
)
from fedlightning.data.temporal.negatives import materialize_negatives
from fedlightning.data.temporal.noise import LabelNoise, draw_noise, noise_settings
from fedlightning.data.temporal.ownership import Ownership, build_ownership
from fedlightning.data.temporal.tasks import Task, TaskSet, build_tasks
from fedlightning.errors import ConfigError
from fedlightning.utils.io import content_hash, write_json

PROTOCOL_VERSION = 2  # 2: unfiltered task negatives (an ablation's)
FILES = ("manifest", "ownership", "tasks", "negatives")


@dataclass
class TemporalProtocol:
    stream: EventStream
    manifest: Manifest
    ownership: Ownership
    tasks: TaskSet
    negatives: dict[str, Any]
    noise: LabelNoise | None = None

    @property
    def event_hashes(self) -> dict[str, str]:
        """The objects that fix which events each party sees, and none of the labels: what
        the bank's contexts and history views are keyed by."""
        return {
            "manifest": self.manifest.hash,
            "ownership": self.ownership.hash,
            "tasks": self.tasks.hash,
            "negatives": content_hash(self.negatives),
        }

    @property
    def hashes(self) -> dict[str, str]:
        """Every object's hash: :attr:`event_hashes` and, with noise on, ``noise``'s."""
        noise = {} if self.noise is None else {"noise": self.noise.hash}
        return {**self.event_hashes, **noise}

    def table(self) -> dict[str, Any]:
        return manifest_table(self.stream, self.manifest)

    def write(self, folder: Path) -> list[Path]:
        """The objects as JSON files (each with its hash) and ``protocol.json``."""
        bodies = {
            "manifest": self.manifest.to_json(),
            "ownership": self.ownership.to_json(),
            "tasks": self.tasks.to_json(),
            "negatives": self.negatives,
        }
        if self.noise is not None:
            bodies["noise"] = self.noise.to_json()
        hashes = self.hashes
        for name, body in bodies.items():
            write_json(folder / f"{name}.json", {"hash": hashes[name], **body})
        summary = {
            "hashes": hashes,
            "table": self.table(),
            "tasks": self.tasks.stats(self.stream),
            "collisions": self.negatives["checks"],
        }
        if self.noise is not None:
            summary["noise"] = self.noise.stats(self.tasks)
        write_json(folder / "protocol.json", summary)
        return [folder / f"{name}.json" for name in (*bodies, "protocol")]


def build_temporal_protocol(stream: EventStream, protocol: dict[str, Any]) -> TemporalProtocol:
    """Every protocol object from ``protocol`` (a plain dict of ``protocol.*``)."""
    seed = int(protocol.get("seed", 2026))
    settings = noise_settings(protocol.get("noise"))  # a bad value fails before any work
    manifest = build_manifest(stream, seed=seed, **protocol.get("manifest", {}))
    ownership = build_ownership(
        stream, manifest.indices(SUP_POOL), seed=seed, **protocol.get("ownership", {})
    )
    tasks = build_tasks(stream, manifest, ownership, seed=seed, **protocol.get("tasks", {}))
    negatives = materialize_negatives(
        stream,
        manifest,
        {t.task: t.events for t in tasks.tasks},
        {"down_val": manifest.indices(DOWN_VAL), "test": manifest.indices(TEST)},
        seed=seed,
        **protocol.get("negatives", {}),
    )
    noise = (
        None if settings is None else draw_noise(stream, ownership, tasks, seed=seed, **settings)
    )
    return TemporalProtocol(stream, manifest, ownership, tasks, negatives, noise)


def cached_protocol(
    stream: EventStream, protocol: dict[str, Any], cache_dir: Path
) -> tuple[TemporalProtocol | None, Path]:
    """A previously materialized protocol for the same stream and parameters, if any (noise
    off keys the cache as before the option existed)."""
    noisy = noise_settings(protocol.get("noise")) is not None
    params = {k: v for k, v in protocol.items() if k != "cache_dir" and (k != "noise" or noisy)}
    key = content_hash(
        {"version": PROTOCOL_VERSION, "stream": stream.fingerprint, "protocol": params}
    )
    folder = Path(cache_dir) / "temporal" / f"{stream.name}-{key}"
    names = (*FILES, "noise") if noisy else FILES
    if not all((folder / f"{n}.json").is_file() for n in names):
        return None, folder
    loaded = {n: json.loads((folder / f"{n}.json").read_text()) for n in names}
    for body in loaded.values():
        body.pop("hash")
    m = loaded["manifest"]
    inductive = np.zeros(stream.num_events, dtype=bool)
    inductive[m["inductive"]] = True
    manifest = Manifest(
        np.array(m["outcome"], dtype=np.int8),
        inductive,
        np.array(m["inductive_nodes"], dtype=np.int64),
        m["bounds"],
        m["params"],
    )
    o = loaded["ownership"]
    ownership = Ownership(np.array(o["owner"], dtype=np.int64), o["clients"], o["params"])

    t = loaded["tasks"]
    tasks = TaskSet(
        [Task(x["task"], {int(k): v for k, v in x["support"].items()}) for x in t["tasks"]],
        t["params"],
    )
    z = loaded.get("noise")
    noise = None if z is None else LabelNoise(z["clients"], z["flipped"], z["params"])
    return TemporalProtocol(stream, manifest, ownership, tasks, loaded["negatives"], noise), folder


def materialize(
    stream: EventStream, protocol: dict[str, Any], cache_dir: Path
) -> tuple[TemporalProtocol, bool]:
    """Load the protocol from the cache or build and cache it; ``True`` when reused."""
    got, folder = cached_protocol(stream, protocol, cache_dir)
    if got is not None:
        return got, True
    built = build_temporal_protocol(stream, protocol)
    built.write(folder)
    return built, False


def materialize_checked(stream: Any, protocol: Any) -> tuple[dict, TemporalProtocol, bool]:
    """:func:`materialize` for a built ``dataset`` and the ``protocol`` config: ``(params,
    protocol, reused)``; a dataset that is not an event stream, or a protocol parameter that
    cannot work on it, is a ConfigError."""
    if not isinstance(stream, EventStream):
        raise ConfigError("dataset", f"{type(stream).__name__} is not a temporal event stream")
    params = OmegaConf.to_container(protocol, resolve=True)
    try:
        proto, reused = materialize(stream, params, Path(params["cache_dir"]))
    except ValueError as e:  # a protocol parameter that cannot work on this stream
        raise ConfigError("protocol", str(e)) from None
    return params, proto, reused


def format_table(row: dict[str, Any]) -> str:
    """The Table 1 row as aligned text."""
    lines = []
    for k, v in row.items():
        shown = f"{v:.6f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else v
        lines.append(f"{k:<12} {shown}")
    return "\n".join(lines)
