"""The scheduler IPC pairs of the Leyline control requests (msgspec ``BaseReq`` subclasses, as
SGLang's own in ``sglang/srt/managers/io_struct.py``).

The payload is JSON text: the body the HTTP process validated (``wire.SpliceRequest``, ...), so
the scheduler re-parses exactly what was accepted; the reply is an HTTP status and a JSON body.
"""

from __future__ import annotations

from leyline_agent.backends.sglang.compat import BaseReq

# NOTE: declared as SGLang declares its own (``class FlushCacheReqInput(BaseReq, kw_only=True)``):
# fields keyword-only. mypy sees BaseReq as Any (sglang is not followed) and rejects the class
# keyword, hence the typed ignores.


class SpliceReqInput(BaseReq, kw_only=True):  # type: ignore[call-arg]
    """``op``: splice, fork, pin or unpin (``SpliceExecutor.handle``). ``dp_rank``: with
    ``--dp-size`` > 1 the one DP rank that runs it (the others answer ``dp.NOT_MINE``); None:
    every rank runs it (``dp.pick_reply`` chooses the reply)."""

    payload: str
    op: str = "splice"
    dp_rank: int | None = None


class SpliceReqOutput(BaseReq, kw_only=True):  # type: ignore[call-arg]
    """``dp_rank``: the DP rank that answered (replies arrive in any order)."""

    status: int
    body: str
    dp_rank: int = 0


class InspectReqInput(BaseReq, kw_only=True):  # type: ignore[call-arg]
    """``payload``: JSON ``{"op": "stats"}`` or (debug endpoints only) ``{"op": "rows", ...}``;
    ``dp_rank`` as for ``SpliceReqInput``."""

    payload: str
    dp_rank: int | None = None


class InspectReqOutput(BaseReq, kw_only=True):  # type: ignore[call-arg]
    status: int
    body: str
    dp_rank: int = 0
