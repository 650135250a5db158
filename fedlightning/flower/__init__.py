"""Flower adapter: the same algorithms as a Flower app (``ServerApp`` + ``ClientApp``).

- :mod:`~fedlightning.flower.records`: our typed messages as Flower records and back.
- :mod:`~fedlightning.flower.runner`: ``runner=flower``, the round loop's clients on nodes.
- :mod:`~fedlightning.flower.node`: a node's side: its client's data, model, state on disk.
- :mod:`~fedlightning.flower.apps`: the ``ServerApp`` and ``ClientApp``, and the simulation.

Flower is an optional dependency (``pip install 'fedlightning[flower]'``).
"""

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # Flower reads it on import: no telemetry
