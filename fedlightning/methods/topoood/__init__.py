"""TopoOOD, a FedOGL baseline: FedAvg + replay with a topology-energy score."""
