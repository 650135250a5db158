"""Aggregation rules as pure functions over named tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fedlightning.messages import ClientUpdate

MODEL_PREFIX = "model."


def weighted_average(
    states: Sequence[dict[str, Tensor]], weights: Sequence[float]
) -> dict[str, Tensor]:
    r"""Weighted mean of state dicts, key by key.

    .. math::
        \bar{w} = \sum_k \frac{n_k}{\sum_j n_j} w_k

    Floating tensors are averaged in float64 and cast back. Integer tensors (buffers such
    as BatchNorm's ``num_batches_tracked``) are averaged the same way and rounded, so
    buffers are aggregated rather than dropped.

    Args:
        states: one state dict per client; all with the same keys and shapes.
        weights: one non-negative weight per client (e.g. training examples), not all zero.
    """
    if len(states) != len(weights) or not states:
        raise ValueError(
            f"need one weight per state, got {len(states)} states, {len(weights)} weights"
        )
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be non-negative and not all zero, got {list(weights)}")
    w = w / w.sum()
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


def model_state(message_tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The model weights inside a message (fields named ``model.<key>``), without the prefix."""
    n = len(MODEL_PREFIX)
    return {k[n:]: v for k, v in message_tensors.items() if k.startswith(MODEL_PREFIX)}


def as_model_fields(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Prefix a model state dict's keys with ``model.`` for a message."""
    return {MODEL_PREFIX + k: v for k, v in state.items()}


def fedavg(updates: Sequence[ClientUpdate]) -> dict[str, Tensor]:
    """FedAvg (McMahan et al., 2017): average of the clients' models weighted by ``num_examples``.

    Parameters and buffers alike. If no client trained on any example (possible in a
    class-incremental stage whose sampled clients observe no new class), the models are
    averaged with equal weights.
    """
    weights = [u.num_examples for u in updates]
    if sum(weights) <= 0:
        weights = [1.0] * len(updates)
    return weighted_average([model_state(u.tensors) for u in updates], weights)
