"""Encoders, fusion and heads."""

from fedlightning.models.dropout import InputDropout, nonzero_dropout
from fedlightning.models.multimodal import (
    GNNEncoder,
    ModalityEncoders,
    MultimodalGNN,
    masked_fusion,
)

__all__ = [
    "GNNEncoder",
    "InputDropout",
    "ModalityEncoders",
    "MultimodalGNN",
    "masked_fusion",
    "nonzero_dropout",
]
