"""The suite's own hygiene: an in-process run that resets logging while a test redirects
``sys.stderr`` closes no stream that pytest (or anyone else) still writes to."""

from __future__ import annotations

import contextlib
import io
import logging.config


def test_a_logging_reset_under_a_redirect_leaves_absls_stream_open():
    """Hydra resets logging with ``dictConfig``, which closes every handler; absl's handler
    closes its stream unless it is the current ``sys.stderr``. conftest points it at
    ``sys.__stderr__``, so the reset under a redirect (what an in-process CLI test does)
    leaves the stream open."""
    import absl.logging

    stream = absl.logging.get_absl_handler().python_handler.stream
    with contextlib.redirect_stderr(io.StringIO()):
        logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})
    assert not stream.closed
