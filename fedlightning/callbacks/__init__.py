"""Lightning callbacks that change how a client trains (gradient shielding, ...)."""

from fedlightning.callbacks.projection import GradientProjection

__all__ = ["GradientProjection"]
