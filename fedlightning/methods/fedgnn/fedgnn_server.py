"""The server of FedGNN (``w_k = 1``) and FedLink (``w_k = n_k``): the weighted mean of the
``dense`` deltas, and of each table row's deltas over the clients that sent it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from fedlightning.messages import ClientUpdate, ServerBroadcast


def row_mean_update(
    table: Tensor, rows: Sequence[Tensor], deltas: Sequence[Tensor], weights: Sequence[float]
) -> Tensor:
    """``table`` plus each row's weighted mean of the deltas sent for it."""
    num = torch.zeros_like(table, dtype=torch.float64)
    den = torch.zeros(len(table), dtype=torch.float64)
    for r, d, w in zip(rows, deltas, weights, strict=True):
        num.index_add_(0, r, d.to(torch.float64) * w)
        den.index_add_(0, r, torch.full((len(r),), float(w), dtype=torch.float64))
    sent = den > 0
    out = table.clone()
    out[sent] = (table[sent].to(torch.float64) + num[sent] / den[sent].unsqueeze(1)).to(table.dtype)
    return out


def row_upload_problem(
    u: ClientUpdate, table: str, n_rows: int, also: Sequence[str] = ()
) -> str | None:
    """Why ``u``'s rows of ``table`` (and index fields ``also``) cannot apply, or ``None``."""
    idx, delta = u.tensors[f"{table}.idx"], u.tensors[f"{table}.delta"]
    if len(idx) != len(delta):
        return f"{table}.delta: {len(delta)} rows for {len(idx)} {table}.idx"
    for name in (f"{table}.idx", *also):
        x = u.tensors.get(name)
        if x is not None and len(x) and (int(x.min()) < 0 or int(x.max()) >= n_rows):
            return f"{name}: rows must lie in 0..{n_rows - 1}"
    if len(torch.unique(idx)) != len(idx):
        return f"{table}.idx: a row sent twice"
    return None


class RowSparseServer:
    """One task's server; ``keys``: the dense parameters in ``dense``'s order; ``weighted``:
    ``w_k`` is the update's ``count``."""

    def __init__(
        self,
        state: Mapping[str, Tensor],
        keys: Sequence[str],
        tables: Sequence[str],
        weighted: bool,
    ) -> None:
        self.params = {k: v.detach().clone() for k, v in state.items()}
        self.keys, self.tables, self.weighted = list(keys), list(tables), weighted

    def state(self) -> dict[str, Tensor]:
        return dict(self.params)

    def dense(self) -> Tensor:
        return torch.cat([self.params[k].reshape(-1) for k in self.keys])

    def broadcast(self, round: int) -> ServerBroadcast:
        tensors = {"dense": self.dense(), **{t: self.params[t] for t in self.tables}}
        return ServerBroadcast(round=round, tensors=tensors)

    def aggregate(self, round: int, updates: Sequence[ClientUpdate]) -> None:
        if not updates:
            return
        w = [float(u.scalars["count"]) if self.weighted else 1.0 for u in updates]
        total = sum(w)
        step = sum(
            wk * u.tensors["dense"].to(torch.float64) for wk, u in zip(w, updates, strict=True)
        )
        flat = (self.dense().to(torch.float64) + step / total).float()
        for k, part in zip(
            self.keys, flat.split([self.params[k].numel() for k in self.keys]), strict=True
        ):
            self.params[k] = part.view_as(self.params[k])
        for t in self.tables:
            table = self.params[t]
            full = torch.arange(len(table))
            rows = [u.tensors.get(f"{t}.idx", full).long() for u in updates]
            deltas = [u.tensors[f"{t}.delta"] for u in updates]
            self.params[t] = row_mean_update(table, rows, deltas, w)


def unflatten_keys(
    flat: Tensor, like: Mapping[str, Tensor], keys: Sequence[str]
) -> dict[str, Tensor]:
    parts = flat.split([like[k].numel() for k in keys])
    return {k: p.view_as(like[k]) for k, p in zip(keys, parts, strict=True)}
