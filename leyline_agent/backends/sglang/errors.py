"""The refusal every Leyline request answers with, and the debug-endpoints switch.

A :class:`SpliceError` carries the HTTP status to answer with; whatever raises it has changed
nothing. Imported by the scheduler-side modules (``preflight``, ``ledger``, ``pins``, ``splice``,
``inspect``); no imports of its own, so anything may import it at module level.
"""

from __future__ import annotations

import os


class SpliceError(Exception):
    """A splice that cannot run; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def debug_enabled() -> bool:
    """``LEYLINE_DEBUG_ENDPOINTS=1``: the test-only request fields and debug views are honoured."""
    return os.environ.get("LEYLINE_DEBUG_ENDPOINTS") == "1"
