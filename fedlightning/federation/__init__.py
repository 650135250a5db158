"""The one round, the schedules, the runners, the ledger (docs/architecture.md)."""
