"""FedTIP: the interaction-conditioned prompt adapter over a frozen TGN/TGAT bank, prototype
anchors and reliability-weighted aggregation, with its comparators and ablations as one
config class (docs/fedtip.md)."""
