"""One folder per method: its algorithm (the verbs it declares on ``Algorithm``), client module,
model parts, server module and score; what two or more methods share lives in the layer
folders below (``clients/``, ``server/``, ``models/``, ``temporal/``, ``metrics/``)."""
