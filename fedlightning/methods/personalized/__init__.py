"""Personalised class-incremental training: each client keeps its own model and
exchanges part of it; the base of FedSSP and FedIIH, with their schedule."""
