"""FedTIP's temporal models: the encoders and the frozen knowledge bank."""
