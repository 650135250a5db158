"""Experiment tracking: MLflow runs, artifacts and plots."""

from fedlightning.tracking.mlflow_tracker import MlflowTracker, NullTracker, flatten

__all__ = ["MlflowTracker", "NullTracker", "flatten"]
