"""Aggregation rules as pure functions over named tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from fedlightning.messages import ClientUpdate

MODEL_PREFIX = "model."


def normalized_weights(items: Sequence[Any], weights: Sequence[float], what: str) -> Tensor:
    """One non-negative weight per state dict or head (``what``), scaled to sum to one."""
    if len(items) != len(weights) or not items:
        raise ValueError(
            f"need one weight per {what}, got {len(items)} {what}s, {len(weights)} weights"
        )
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    if not torch.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(
            f"weights must be finite, non-negative and not all zero, got {list(weights)}"
        )
    if not torch.isfinite(w.sum()):  # two weights near 1.7e308 overflow their sum
        w = w / w.max()  # (only then: an ordinary run keeps its bits)
    return w / w.sum()


def weighted_average(
    states: Sequence[dict[str, Tensor]], weights: Sequence[float]
) -> dict[str, Tensor]:
    r"""Weighted mean of state dicts, key by key.

    .. math::
        \bar{w} = \sum_k \frac{n_k}{\sum_j n_j} w_k

    In float64, cast back; integer buffers (e.g. ``num_batches_tracked``) are rounded.
    ``states`` share keys and shapes; ``weights`` are non-negative, not all zero."""
    w = normalized_weights(states, weights, "state")
    keys = list(states[0])
    for s in states[1:]:
        if list(s) != keys:
            raise ValueError("states disagree on their keys")
    out = {}
    for k in keys:
        stacked = torch.stack([s[k].to(torch.float64) for s in states])
        mean = torch.tensordot(w, stacked, dims=1)
        dtype = states[0][k].dtype
        out[k] = mean.to(dtype) if dtype.is_floating_point else mean.round().to(dtype)
    return out


def strip_prefix(fields: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The fields named ``<prefix><key>``, by ``key`` (in order)."""
    return {k[len(prefix) :]: v for k, v in fields.items() if k.startswith(prefix)}


def model_state(message_tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The model weights inside a message (fields named ``model.<key>``), without the prefix."""
    return strip_prefix(message_tensors, MODEL_PREFIX)


def as_model_fields(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Prefix a model state dict's keys with ``model.`` for a message."""
    return {MODEL_PREFIX + k: v for k, v in state.items()}


def fedavg(updates: Sequence[ClientUpdate]) -> dict[str, Tensor]:
    """FedAvg (McMahan et al., 2017): the clients' models (parameters and buffers) weighted by
    ``num_examples``, or equally if no client trained on any example (possible in a
    class-incremental stage)."""
    weights = [u.num_examples for u in updates]
    if sum(weights) <= 0:
        weights = [1.0] * len(updates)
    return weighted_average([model_state(u.tensors) for u in updates], weights)


def clip_update(
    state: dict[str, Tensor], reference: dict[str, Tensor], max_norm: float
) -> dict[str, Tensor]:
    r"""``state`` moved back towards ``reference`` so that its update has L2 norm at most
    ``max_norm``, over every floating field (integer buffers are kept):

    .. math::
        w_k \leftarrow \bar{w} + \Delta_k \min(1, C / \lVert\Delta_k\rVert_2),
        \quad \Delta_k = w_k - \bar{w}

    (the clipping of DP-FedAvg, McMahan et al., ICLR 2018, without the noise)."""
    floats = [k for k, v in state.items() if v.is_floating_point()]
    deltas = {k: state[k].double() - reference[k].double() for k in floats}
    norm = float(torch.sqrt(sum((d * d).sum() for d in deltas.values()))) if floats else 0.0
    if norm <= max_norm:
        return state
    scale = max_norm / norm
    out = dict(state)
    for k in floats:
        out[k] = (reference[k].double() + scale * deltas[k]).to(state[k].dtype)
    return out


def bound_update(
    update: ClientUpdate,
    reference: dict[str, Tensor],
    max_update_norm: float | None = None,
    max_client_weight: float | None = None,
) -> ClientUpdate:
    """``update`` with its model clipped to ``max_update_norm`` around ``reference`` (the
    broadcast global model; :func:`clip_update`) and its ``num_examples`` capped at
    ``max_client_weight`` (``None``: no bound); other fields unchanged."""
    tensors, scalars = update.tensors, update.scalars
    if max_update_norm is not None:
        clipped = clip_update(model_state(tensors), reference, max_update_norm)
        tensors = {**tensors, **as_model_fields(clipped)}
    if max_client_weight is not None and "num_examples" in scalars:
        scalars = {
            **scalars,
            "num_examples": min(float(scalars["num_examples"]), max_client_weight),
        }
    return ClientUpdate(update.round, tensors, scalars, client_id=update.client_id)
