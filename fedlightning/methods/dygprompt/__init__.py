"""DyGPrompt (Yu et al., ICLR 2025): node and time prompts with dual condition-nets on the
frozen bank, centralised and direct FedAvg, FedTIP's Table 3 comparators (docs/fedtip.md)."""
