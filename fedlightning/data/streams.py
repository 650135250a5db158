"""The open-world class-incremental stream over a partitioned graph: a protocol object."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedlightning.data.graphs.base import MultimodalGraph
from fedlightning.data.partition import TRAIN, Partition
from fedlightning.errors import ConfigError
from fedlightning.utils.io import ContentHashed, write_json
from fedlightning.utils.seeding import derive_seed

UNKNOWN = -1
STAGES_KEY = "protocol.stream.stages"

# Classes of the built-in datasets, known from their config alone: (loader, `name`) -> C.
_BUILTIN_CLASSES = {
    ("fedlightning.data.graphs.load_planetoid", "cora"): 7,
    ("fedlightning.data.graphs.load_planetoid", "citeseer"): 6,
    ("fedlightning.data.graphs.load_citeseer_mm", None): 6,
}


def check_stages(
    stages: Any, num_classes: int | None = None, dataset: str = "the dataset"
) -> list[int]:
    """Check a class-incremental stage layout (``protocol.stream.stages``: a list, tuple or
    ``ListConfig``) under rules 1-3 of ``docs/datasets.md``; return it as ints. With
    ``num_classes`` ``None`` (:func:`config_num_classes` does not know it) only the layout is
    checked. A violation is a one-line ConfigError naming the key; ``dataset`` is how
    messages name the dataset."""
    if isinstance(stages, (str, bytes, Mapping)) or not hasattr(stages, "__iter__"):
        raise ConfigError(
            STAGES_KEY, f"expected a list of classes per stage such as [2, 1, 1], got {stages!r}"
        )
    raw = list(stages)
    out = []
    for v in raw:
        ok = isinstance(v, int) or (isinstance(v, float) and v.is_integer())
        if isinstance(v, bool) or not ok:
            raise ConfigError(
                STAGES_KEY, f"expected integer class counts such as [2, 1, 1], got {raw}"
            )
        out.append(int(v))
    if not out or out[0] < 2 or min(out) < 1:
        raise ConfigError(
            STAGES_KEY,
            f"need a first stage of >= 2 classes and >= 1 class per later stage, got {out}",
        )
    if num_classes is not None:
        c = int(num_classes)
        if c < 3:
            raise ConfigError(
                STAGES_KEY,
                f"{dataset} has {c} classes; a class-incremental stream needs >= 3 (2 in the "
                "first stage, 1 never introduced)",
            )
        if sum(out) > c - 1:
            raise ConfigError(
                STAGES_KEY,
                f"{out} introduce {sum(out)} classes, but {dataset} has {c}: at least one "
                f"must stay unknown (at most {c - 1} in all, e.g. {[2] + [1] * (c - 3)})",
            )
    return out


def config_num_classes(dataset: Mapping[str, Any]) -> int | None:
    """The number of classes a ``dataset`` config fixes without reading data: its
    ``num_classes`` (``dataset=synthetic``), a built-in dataset's known count, else ``None``
    (a folder or any other dataset)."""
    n = dataset.get("num_classes")
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    target = str(dataset.get("_target_", ""))
    for (loader, name), c in _BUILTIN_CLASSES.items():
        if target == loader and (name is None or dataset.get("name") == name):
            return c
    return None


@dataclass
class ClassStream(ContentHashed):
    r"""Which classes arrive at which stage, and which client observes which of them.

    After stage ``t`` (0-based) the known classes are
    :math:`\mathcal{C}_K^t = \bigcup_{s \le t} \mathcal{C}_s`; every other class is unknown
    (FedOGL Eq. (1)): future classes while they are in the future, and the never-introduced
    classes for good, so open-set metrics exist after the last stage.

    Args:
        stages: the classes each stage introduces, in order.
        never: classes never introduced.
        observed: ``observed[k][t]``: the classes of ``stages[t]`` whose labels client ``k``
            may use at stage ``t`` (its supervised nodes are its training nodes of these).
        meta: the inputs (stage sizes, fraction, seed, graph and partition hashes)."""

    stages: list[list[int]]
    never: list[int]
    observed: list[list[list[int]]]
    meta: dict[str, Any]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def known(self, t: int) -> list[int]:
        """Known classes after stage ``t``: those introduced at stages ``0..t``."""
        return sorted(c for s in self.stages[: t + 1] for c in s)

    def known_mask(self, t: int, num_classes: int) -> Tensor:
        mask = torch.zeros(num_classes, dtype=torch.bool)
        mask[self.known(t)] = True
        return mask

    def class_stage(self, num_classes: int) -> Tensor:
        """The stage that introduces each class, ``-1`` for never-introduced classes."""
        out = torch.full((num_classes,), UNKNOWN, dtype=torch.long)
        for t, classes in enumerate(self.stages):
            out[classes] = t
        return out

    def to_json(self) -> dict[str, Any]:
        return {**self.meta, "stages": self.stages, "never": self.never, "observed": self.observed}

    def save(self, path: str | Path) -> None:
        write_json(path, {**self.to_json(), "hash": self.hash})

    @classmethod
    def load(cls, path: str | Path) -> ClassStream:
        obj = json.loads(Path(path).read_text())
        stored = obj.pop("hash")
        stream = cls(obj.pop("stages"), obj.pop("never"), obj.pop("observed"), obj)
        if stream.hash != stored:
            raise ValueError(f"{path}: stream content hashes to {stream.hash}, file says {stored}")
        return stream


class ClassIncrementalStream:
    """Builds a :class:`ClassStream` from stage sizes (e.g. ``[2, 1, 1, 1]``), seeded by
    ``protocol.seed``, under the rules of ``docs/datasets.md`` (the class order and which
    classes each client observes, ``client_fraction`` in (0, 1])."""

    def __init__(self, stages: list[int], client_fraction: float = 1.0) -> None:
        stages = check_stages(stages)
        if not 0 < float(client_fraction) <= 1:
            raise ConfigError(
                "protocol.stream.client_fraction", f"must lie in (0, 1], got {client_fraction}"
            )
        self.stage_sizes = stages
        self.client_fraction = float(client_fraction)

    def __call__(self, graph: MultimodalGraph, partition: Partition, seed: int) -> ClassStream:
        c = graph.num_classes
        check_stages(self.stage_sizes, c, dataset=repr(graph.name))  # now C is known
        order = np.random.default_rng(derive_seed(seed, "class_order")).permutation(c).tolist()
        cuts = np.cumsum([0, *self.stage_sizes]).tolist()
        stages = [sorted(order[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        never = sorted(order[cuts[-1] :])
        k_clients = partition.num_clients
        train = partition.split == TRAIN
        cell = partition.assignment[train] * c + graph.y[train]
        counts = torch.bincount(cell, minlength=k_clients * c).view(k_clients, c)  # train nodes
        observed: list[list[list[int]]] = [[] for _ in range(k_clients)]
        for t, new in enumerate(stages):
            rng = np.random.default_rng(derive_seed(seed, "observe", t))
            picks: list[list[int]] = []
            for k in range(k_clients):
                present = [cl for cl in new if counts[k, cl] > 0]
                m = math.ceil(self.client_fraction * len(present))
                chosen = rng.choice(present, size=m, replace=False).tolist() if m else []
                picks.append(sorted(int(x) for x in chosen))
            for cl in new:
                if not any(cl in p for p in picks):
                    owner = int(counts[:, cl].argmax())
                    if counts[owner, cl] == 0:
                        raise ConfigError(
                            "protocol.stream.stages",
                            f"class {graph.class_names[cl]!r} of stage {t + 1} has no "
                            "training node on any client",
                        )
                    picks[owner] = sorted([*picks[owner], cl])
            for k in range(k_clients):
                observed[k].append(picks[k])
        meta = {
            "stage_sizes": self.stage_sizes,
            "client_fraction": self.client_fraction,
            "seed": int(seed),
            "graph": graph.fingerprint(),
            "partition": partition.hash,
            "class_names": list(graph.class_names),
        }
        return ClassStream(stages, never, observed, meta)
