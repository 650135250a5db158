"""Temporal interaction streams (FedTIP): the typed stream, its file readers, a synthetic one."""

from fedlightning.data.temporal.events import EventStream
from fedlightning.data.temporal.loaders import (
    load_bitcoin_csv,
    load_interactions,
    load_jodie_csv,
    load_wikipedia_txt,
    make_synthetic_stream,
)

__all__ = [
    "EventStream",
    "load_jodie_csv",
    "load_wikipedia_txt",
    "load_bitcoin_csv",
    "load_interactions",
    "make_synthetic_stream",
]
