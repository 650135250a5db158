"""Full-model FedAvg of the bank and a head: FedTIP's uplink comparator."""
