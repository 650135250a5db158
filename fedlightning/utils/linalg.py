"""Small linear-algebra helpers shared by methods and metrics."""

from __future__ import annotations

import torch
from torch import Tensor


def fix_signs(u: Tensor) -> Tensor:
    """Flip each column so that its largest-magnitude entry is positive (first on ties), so
    that a basis from an eigen- or singular-value decomposition is deterministic."""
    if u.size(1) == 0:
        return u
    idx = u.abs().argmax(dim=0)
    signs = torch.sign(u.gather(0, idx.unsqueeze(0))).squeeze(0)
    signs[signs == 0] = 1.0
    return u * signs
