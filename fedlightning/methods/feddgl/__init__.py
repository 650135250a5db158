"""FedDGL, a FedTIP Table 2 baseline: prototype generator and mixing weights on the server
(docs/fedtip.md)."""
