"""The refusal every Leyline request answers with, and the debug-endpoints switch.

A :class:`SpliceError` carries the HTTP status to answer with; whatever raises it has changed
nothing. Imported by the scheduler-side modules (``preflight``, ``ledger``, ``pins``, ``splice``,
``inspect``); no imports of its own, so anything may import it at module level.
"""

from __future__ import annotations

import os


class SpliceError(Exception):
    """A splice that cannot run; ``status`` is the HTTP status to answer with.

    ``error_type``: None answers ``{"error": message}`` (Leyline's own refusals); a type (e.g.
    ``"invalid_request_error"``) answers in SGLang's error format, ``{"error": {"message",
    "type", "code"}}``, as SGLang refuses the request that would follow (a context length).
    """

    def __init__(self, status: int, message: str, *, error_type: str | None = None):
        super().__init__(message)
        self.status = status
        self.error_type = error_type

    def body(self) -> dict[str, object]:
        """The JSON body to answer with."""
        if self.error_type is None:
            return {"error": str(self)}
        return {"error": {"message": str(self), "type": self.error_type, "code": self.status}}


def debug_enabled() -> bool:
    """``LEYLINE_DEBUG_ENDPOINTS=1``: the test-only request fields and debug views are honoured."""
    return os.environ.get("LEYLINE_DEBUG_ENDPOINTS") == "1"
