"""Client-side loss terms, one function each."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def proximal_term(
    params: Iterable[tuple[str, Tensor]], anchor: dict[str, Tensor], mu: float
) -> Tensor:
    r"""FedProx's proximal term (Li et al., 2020, Eq. (2)).

    .. math::
        \frac{\mu}{2} \lVert w - w^t \rVert_2^2

    Args:
        params: ``(name, parameter)`` pairs of the local model ``w``.
        anchor: name -> the global weights ``w^t`` received this round (no gradient).
        mu: the proximal coefficient (``0`` gives FedAvg).
    """
    total = torch.zeros(())
    for name, p in params:
        total = total + (p - anchor[name]).pow(2).sum()
    return 0.5 * mu * total
