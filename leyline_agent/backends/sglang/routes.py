"""HTTP routes added to SGLang's FastAPI app (main process only).

No ``from __future__ import annotations`` here: FastAPI resolves the handlers' annotations at
registration time.
"""

import json
import os
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from leyline_agent.backends.sglang.compat import http_server
from leyline_agent.backends.sglang.dp import (
    Reply,
    home_rank,
    merge_stats,
    pick_reply,
    rank_of_pin,
)
from leyline_agent.backends.sglang.ipc import InspectReqInput, SpliceReqInput
from leyline_agent.backends.sglang.mux import RidMux
from leyline_agent.wire import (
    ForkRequest,
    PinRequest,
    SpliceRequest,
    UnpinRequest,
)


def _tokenizer_manager():
    tm = http_server.get_global_state().tokenizer_manager
    tm.auto_create_handle_loop()
    return tm


def _dp_size(tm) -> int:
    return int(getattr(tm, "elastic_worker_count", 1) or 1)


def _bad_rank(rank: int | None, dp_size: int) -> JSONResponse | None:
    if rank is None or 0 <= rank < dp_size:
        return None
    return JSONResponse({"error": f"dp_rank {rank} out of range [0, {dp_size})"}, status_code=422)


async def _control(request: Request, op: str, model: type[BaseModel]) -> JSONResponse:
    """Validate the body (422), pick the DP rank, run ``op`` in the scheduler, answer its reply."""
    raw = await request.body()
    try:
        body: Any = model.model_validate_json(raw)
    except ValidationError as e:
        detail = json.loads(e.json(include_url=False, include_input=False))
        return JSONResponse({"error": f"invalid {op} request", "detail": detail}, status_code=422)
    status, result = await execute(op, body)
    return JSONResponse(result, status_code=status)


async def execute(op: str, body: Any) -> tuple[int, Any]:
    """Run the validated control request ``body`` (``op``: splice, fork, pin, unpin) on the DP
    rank that holds its namespace; ``(http_status, the JSON answer)``. Also the in-band splice's
    executor (``inband.py``)."""
    tm = _tokenizer_manager()
    n = _dp_size(tm)
    # DP: the rank that holds the namespace (dp.py); every worker answers, replies in any order
    if op == "unpin":
        target = body.dp_rank
        if target is None and body.pin_id is not None and n > 1:
            target = rank_of_pin(body.pin_id)
    else:
        target = body.dp_rank
        if target is None:
            target = home_rank(body.extra_key, body.cache_salt, n)
        dst = getattr(body, "target_extra_key", None)
        if n > 1 and dst is not None and body.dp_rank is None:
            if home_rank(dst, body.cache_salt, n) != target:
                return 501, {
                    "error": f"{op} across DP ranks is not supported: namespace {dst!r} "
                    f"lives on another DP rank than {body.extra_key!r}"
                }
    if target is not None and not 0 <= target < n:
        return 422, {"error": f"dp_rank {target} out of range [0, {n})"}
    req = SpliceReqInput(payload=body.model_dump_json(), op=op, dp_rank=target)
    outs = await tm.leyline_splice_communicator(req)
    if op == "unpin" and target is None and len(outs) > 1:  # by owner: every rank releases
        bodies = [json.loads(o.body) for o in outs if o.status == 200]
        if len(bodies) == len(outs):
            return 200, {k: sum(b[k] for b in bodies) for k in ("released", "pinned_slots")}
    out = pick_reply([Reply(o.dp_rank, o.status, o.body) for o in outs], target)
    result = json.loads(out.body)
    if n > 1 and isinstance(result, dict):
        result["dp_rank"] = out.dp_rank
    return out.status, result


async def splice(request: Request) -> JSONResponse:
    """Execute AMORTIZE / FORGET directives on a cached sequence (body: ``SpliceRequest``)."""
    return await _control(request, "splice", SpliceRequest)


async def fork(request: Request) -> JSONResponse:
    """Copy a cached sequence's KV into another namespace (body: ``ForkRequest``)."""
    return await _control(request, "fork", ForkRequest)


async def pin(request: Request) -> JSONResponse:
    """Keep a cached prefix resident for a TTL (body: ``PinRequest``)."""
    return await _control(request, "pin", PinRequest)


async def unpin(request: Request) -> JSONResponse:
    """Release a pin, or every pin of an owner (body: ``UnpinRequest``)."""
    return await _control(request, "unpin", UnpinRequest)


async def _inspect(payload: dict) -> JSONResponse:
    """``stats``: every DP rank's, merged (``dp.merge_stats``); other ops: one rank's (the
    payload's ``dp_rank``, else the home rank of its ``extra_key``, else rank 0)."""
    tm = _tokenizer_manager()
    n = _dp_size(tm)
    target = None
    if payload.get("op") != "stats" and n > 1:
        target = payload.get("dp_rank")
        if target is None:
            target = home_rank(payload.get("extra_key"), payload.get("cache_salt"), n) or 0
    if (bad := _bad_rank(target, n)) is not None:
        return bad
    req = InspectReqInput(payload=json.dumps(payload), dp_rank=target)
    outs = await tm.leyline_inspect_communicator(req)
    if target is None and len(outs) > 1:
        ordered = sorted(outs, key=lambda o: o.dp_rank)
        if all(o.status == 200 for o in ordered):
            return JSONResponse(merge_stats([json.loads(o.body) for o in ordered]))
    out = pick_reply([Reply(o.dp_rank, o.status, o.body) for o in outs], target)
    return JSONResponse(json.loads(out.body), status_code=out.status)


async def stats() -> JSONResponse:
    """Allocator and tree counters (free + cached + in use == total); with ``--dp-size`` > 1
    summed over the DP ranks, each rank's under ``dp_workers``. ``control``: the splice
    communicator's requests and how many were in flight at once (``mux.RidMux.figures``)."""
    resp = await _inspect({"op": "stats"})
    comm = getattr(_tokenizer_manager(), "leyline_splice_communicator", None)
    if resp.status_code != 200 or not isinstance(comm, RidMux):
        return resp
    return JSONResponse({**json.loads(bytes(resp.body)), "control": comm.figures()})


async def debug_inspect(request: Request) -> JSONResponse:
    """Debug only (``LEYLINE_DEBUG_ENDPOINTS=1``): KV rows of a cached sequence, tree slots."""
    return await _inspect(json.loads(await request.body()))


def add_routes() -> None:
    """Idempotent."""
    if any(getattr(r, "path", None) == "/leyline/splice" for r in http_server.app.routes):
        return
    from leyline_agent.backends.sglang.inband import InbandSplice

    http_server.app.add_middleware(InbandSplice)  # leyline_splice on /generate and chat
    http_server.app.add_api_route("/leyline/splice", splice, methods=["POST"])
    http_server.app.add_api_route("/leyline/fork", fork, methods=["POST"])
    http_server.app.add_api_route("/leyline/pin", pin, methods=["POST"])
    http_server.app.add_api_route("/leyline/unpin", unpin, methods=["POST"])
    http_server.app.add_api_route("/leyline/stats", stats, methods=["GET"])
    if os.environ.get("LEYLINE_DEBUG_ENDPOINTS") == "1":
        http_server.app.add_api_route("/leyline/debug/inspect", debug_inspect, methods=["POST"])
