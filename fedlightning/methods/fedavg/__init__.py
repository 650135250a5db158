"""FedAvg (McMahan et al. 2017): local SGD steps, example-weighted model average."""
