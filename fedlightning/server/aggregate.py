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
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be non-negative and not all zero, got {list(weights)}")
    return w / w.sum()


def weighted_average(
    states: Sequence[dict[str, Tensor]], weights: Sequence[float]
) -> dict[str, Tensor]:
    r"""Weighted mean of state dicts, key by key.

    .. math::
        \bar{w} = \sum_k \frac{n_k}{\sum_j n_j} w_k

    In float64, cast back; integer buffers (e.g. ``num_batches_tracked``) are rounded.
    ``states`` share keys and shapes; ``weights`` are non-negative, not all zero.
    """
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
