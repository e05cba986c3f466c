"""HTTP routes added to SGLang's FastAPI app (main process only).

No ``from __future__ import annotations`` here: FastAPI resolves the handlers' annotations at
registration time.
"""

import json
import os

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from leyline_agent.backends.sglang.compat import http_server
from leyline_agent.backends.sglang.ipc import InspectReqInput, SpliceReqInput
from leyline_agent.backends.sglang.wire import SpliceRequest


def _tokenizer_manager():
    tm = http_server.get_global_state().tokenizer_manager
    tm.auto_create_handle_loop()
    return tm


async def splice(request: Request) -> JSONResponse:
    """Execute AMORTIZE / FORGET directives on a cached sequence (body: ``SpliceRequest``)."""
    raw = await request.body()
    try:
        body = SpliceRequest.model_validate_json(raw)
    except ValidationError as e:
        detail = json.loads(e.json(include_url=False))
        return JSONResponse({"error": "invalid splice request", "detail": detail}, status_code=422)
    req = SpliceReqInput(payload=body.model_dump_json())
    out = (await _tokenizer_manager().leyline_splice_communicator(req))[0]
    return JSONResponse(json.loads(out.body), status_code=out.status)


async def _inspect(payload: dict) -> JSONResponse:
    req = InspectReqInput(payload=json.dumps(payload))
    out = (await _tokenizer_manager().leyline_inspect_communicator(req))[0]
    return JSONResponse(json.loads(out.body), status_code=out.status)


async def stats() -> JSONResponse:
    """Allocator and tree counters (free + cached + in use == total)."""
    return await _inspect({"op": "stats"})


async def debug_inspect(request: Request) -> JSONResponse:
    """Debug only (``LEYLINE_DEBUG_ENDPOINTS=1``): KV rows of a cached sequence, tree slots."""
    return await _inspect(json.loads(await request.body()))


def add_routes() -> None:
    """Idempotent."""
    if any(getattr(r, "path", None) == "/leyline/splice" for r in http_server.app.routes):
        return
    http_server.app.add_api_route("/leyline/splice", splice, methods=["POST"])
    http_server.app.add_api_route("/leyline/stats", stats, methods=["GET"])
    if os.environ.get("LEYLINE_DEBUG_ENDPOINTS") == "1":
        http_server.app.add_api_route("/leyline/debug/inspect", debug_inspect, methods=["POST"])
