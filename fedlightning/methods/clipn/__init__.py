"""CLIPN, a FedOGL baseline: FedAvg + replay with a "no" branch and the ATD score."""
