"""Encoders, fusion and heads."""

from fedlightning.models.multimodal import (
    GNNEncoder,
    ModalityEncoders,
    MultimodalGNN,
    masked_fusion,
)

__all__ = ["GNNEncoder", "ModalityEncoders", "MultimodalGNN", "masked_fusion"]
