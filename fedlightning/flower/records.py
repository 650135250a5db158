"""Our typed messages as Flower records, and back: a ``RecordDict`` of ``tensors`` (an
``ArrayRecord``, dtype and shape kept) and ``scalars`` (a ``MetricRecord``). Decoding gives
bitwise the same fields, so the ledger counts a message the same on a wire or in process."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedlightning.messages import ClientUpdate, Message, ServerBroadcast

TENSORS, SCALARS, COUNTS, TASK = "tensors", "scalars", "counts", "task"
UPDATE_RECORDS = (TENSORS, SCALARS)  # what a ClientApp's train reply may hold


def tensor_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """Named tensors as an ``ArrayRecord`` (CPU, contiguous; order kept)."""
    record = ArrayRecord()
    for name, t in tensors.items():
        record[name] = Array(t.detach().cpu().contiguous())
    return record


def record_tensors(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """An ``ArrayRecord`` back as named tensors."""
    return {name: torch.from_numpy(array.numpy().copy()) for name, array in record.items()}


def records_message(content: RecordDict, kind: type = ServerBroadcast, **fields: Any) -> Any:
    """The ``kind`` message (with ``fields``) of a ``RecordDict``'s tensors and scalars."""
    return kind(tensors=record_tensors(content[TENSORS]), scalars=dict(content[SCALARS]), **fields)


def message_records(message: Message | None, task: Mapping[str, Any] | None = None) -> RecordDict:
    """``message``'s fields as records, plus an optional ``task`` ``ConfigRecord`` (what to do
    with them: round, client, kind, parameters; sent server -> client only). ``None`` (a
    client with nothing to send) is a reply without records."""
    if message is None:
        return RecordDict({})
    records: dict[str, Any] = {
        TENSORS: tensor_record(message.tensors),
        SCALARS: MetricRecord({k: float(v) for k, v in message.scalars.items()}),
    }
    if task is not None:
        records[TASK] = ConfigRecord(dict(task))
    return RecordDict(records)


def records_update(content: RecordDict, round: int, client_id: int) -> ClientUpdate | None:
    """A ClientApp's train reply as a :class:`ClientUpdate` (``None`` for a reply with no
    record: the client had nothing to send); any record beyond the declared ``tensors`` and
    ``scalars`` is refused."""
    extra = sorted(set(content.keys()) - set(UPDATE_RECORDS))
    if extra:
        raise ValueError(f"client {client_id} sent undeclared records {extra}")
    if not list(content.keys()):
        return None
    return records_message(content, ClientUpdate, round=round, client_id=client_id)


def content_fields(content: RecordDict) -> dict[str, dict[str, list[int]]]:
    """What a ``RecordDict`` carries: record -> field -> ``[values, payload bytes]`` (an
    array's elements times its item size; a metric or config number is one 8-byte value).
    The ClientApp's audit log writes this for every reply it sends."""
    out: dict[str, dict[str, list[int]]] = {}
    for name, record in content.items():
        if isinstance(record, ArrayRecord):
            out[name] = {k: _array_size(a) for k, a in record.items()}
        else:
            out[name] = {k: [1, 8] for k in record}
    return out


def _array_size(array: Array) -> list[int]:
    values = int(np.prod(array.shape))
    return [values, values * np.dtype(array.dtype).itemsize]
