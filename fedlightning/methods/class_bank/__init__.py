"""FedAvg + replay + MSP with a server-written class prototype bank: the base of FedMVP
and PRISM."""
