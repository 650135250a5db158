"""FedProx (Li et al. 2020): FedAvg with the proximal term mu/2 ||w - w_global||^2."""
