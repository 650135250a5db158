"""The zero-shot row: the frozen bank's own similarity template scored on FedTIP's tasks,
with no training and no message (docs/fedtip.md)."""
