"""Wire types of the splice endpoint.

HTTP body (pydantic, validated in the HTTP process) and the IPC pair that carries it to the
scheduler (msgspec ``BaseReq`` subclasses, as SGLang's own control requests in
``sglang/srt/managers/io_struct.py``). The IPC payload is the validated JSON text, so the scheduler
side re-parses exactly what the HTTP side accepted.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictInt
from sglang.srt.managers.io_struct import BaseReq

from leyline_agent.directive import Directive


class SpliceRequest(BaseModel):
    """``POST /leyline/splice`` body.

    tokens: the cached sequence (token ids) the directives refer to.
    directives: non-overlapping edits in old-sequence coordinates.
    extra_key: radix-cache namespace (SGLang's ``extra_key``); None is the default namespace.
    cache_salt: SGLang's ``cache_salt`` (also a namespace component).
    """

    model_config = ConfigDict(extra="forbid")

    tokens: list[StrictInt] = Field(min_length=1)
    directives: list[Directive] = Field(min_length=1)
    extra_key: str | None = None
    cache_salt: str | None = None
    # test-only, honoured only with LEYLINE_DEBUG_ENDPOINTS=1 (see backends/sglang/ledger.py)
    debug_fault: str | None = None
    debug_fail_after_prefill: bool = False


class SpliceResponse(BaseModel):
    """``POST /leyline/splice`` result. Field names are a public contract: keep them.

    new_length: tokens of the spliced sequence now in the tree.
    prefix_reused: unchanged prefix tokens matched in the radix tree (first directive's start).
    prefilled: tokens run through the model (replacements; for FORGET, everything after it).
    rotated: downstream tokens whose KV was kept and δ-rotated.
    copied: downstream slots copied before rotation (another path shared them).
    purged: slots removed from the tree by FORGET.
    in_place: True when the downstream tail was rotated in place (owned by this path alone).
    elapsed_ms: scheduler-side wall time of the whole splice, in milliseconds.
    cached_before: tokens of ``tokens`` found cached (always all of them on success).
    timings_ms: the splice broken down, in milliseconds: ``prefill`` (replacement prefills),
        ``rotate`` (δ-rotation, copies and in place), ``tree`` (detach, purge, insert, frees).
    """

    new_length: int
    prefix_reused: int
    prefilled: int
    rotated: int
    copied: int = 0
    purged: int = 0
    in_place: bool
    elapsed_ms: float
    cached_before: int = 0
    timings_ms: dict[str, float] = Field(default_factory=dict)


class SpliceReqInput(BaseReq, kw_only=True):
    payload: str


class SpliceReqOutput(BaseReq, kw_only=True):
    status: int
    body: str


class InspectReqInput(BaseReq, kw_only=True):
    """``payload``: JSON ``{"op": "stats"}`` or (debug endpoints only) ``{"op": "rows", ...}``."""

    payload: str


class InspectReqOutput(BaseReq, kw_only=True):
    status: int
    body: str
