"""Flower adapter: the same algorithms as a Flower app (``ServerApp`` + ``ClientApp``; its
modules: docs/architecture.md). Optional: ``pip install 'fedlightning[flower]'``."""

import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # Flower reads it on import: no telemetry
