"""Metrics: class-incremental accuracy matrix, open-world rejection, retrieval, drift."""

from fedlightning.metrics.accuracy_matrix import (
    AccuracyMatrix,
    average_accuracy,
    forgetting,
    forgetting_diag,
    seen_accuracy_curve,
)
from fedlightning.metrics.diagnostics import (
    basis_drift,
    class_centroids,
    discrepancy_spread,
    dispersion_of,
    principal_basis,
    prototype_discrepancies,
    prototype_dispersion,
    semantic_drift,
)
from fedlightning.metrics.open_set import (
    auroc_known_vs_unknown,
    energy_score,
    fpr_at_threshold,
    fpr_at_tpr,
    msp_score,
    open_accuracy,
    threshold_at_tpr,
)
from fedlightning.metrics.retrieval import cosine_similarity_matrix, max_similarity, recall_at_k

__all__ = [
    "AccuracyMatrix",
    "auroc_known_vs_unknown",
    "average_accuracy",
    "basis_drift",
    "class_centroids",
    "cosine_similarity_matrix",
    "discrepancy_spread",
    "dispersion_of",
    "energy_score",
    "forgetting",
    "forgetting_diag",
    "fpr_at_threshold",
    "fpr_at_tpr",
    "max_similarity",
    "msp_score",
    "open_accuracy",
    "principal_basis",
    "prototype_discrepancies",
    "prototype_dispersion",
    "recall_at_k",
    "seen_accuracy_curve",
    "semantic_drift",
    "threshold_at_tpr",
]
