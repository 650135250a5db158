"""GRASP, a FedOGL baseline: FedAvg + replay with a propagated (post hoc) score."""
