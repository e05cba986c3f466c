"""Every route the proxy does not handle itself, forwarded to the backend as is (``app.py``'s
catch-all): ``/v1/completions``, ``/v1/models/{id}``, ... never the proxy's bare 404."""

from __future__ import annotations

import json

import httpx
from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from leyline_agent.placement import shared_namespace
from leyline_agent.proxy.auth import tenant_of
from leyline_agent.proxy.backends import BackendPool
from leyline_agent.proxy.metrics import RouteCounters
from leyline_agent.proxy.responses import error_response, unreachable


async def forward(
    pool: BackendPool, request: Request, path: str, routes: RouteCounters
) -> Response:
    """Any other route the backend serves (``/v1/completions``, ``/v1/models/{id}``, ...):
    sent to the first backend up as is, with the backend's key, the answer streamed back
    unchanged. ``POST /v1/completions`` goes in the caller's tenant's shared namespace
    (exact KV, as a chat session's before its first splice): a repeated prompt is a hit,
    never one of another tenant's. No policy runs (there are no messages)."""
    routes.request("/v1/completions" if path == "v1/completions" else "forwarded")
    backend = next(iter(pool.up()), pool.first)
    content = await request.body()
    if path == "v1/completions" and request.method == "POST":
        try:
            body = json.loads(content or b"null")
        except ValueError:
            return error_response(400, "the request body is not JSON", "invalid_request_error")
        if isinstance(body, dict):
            body["extra_key"] = shared_namespace(tenant_of(request))
            content = json.dumps(body).encode()
    keep = ("content-type", "accept")
    headers = {k: v for k, v in request.headers.items() if k.lower() in keep}
    url = httpx.URL(path="/" + path, query=request.url.query.encode())
    req = backend.http.build_request(request.method, url, content=content, headers=headers)
    try:
        upstream = await backend.http.send(req, stream=True)
    except httpx.HTTPError as e:
        backend.count(error=True)
        return unreachable(backend.url, e)
    backend.count(error=upstream.status_code >= 500)
    media = upstream.headers.get("content-type", "application/json")
    return StreamingResponse(
            upstream.aiter_raw(), status_code=upstream.status_code, media_type=media,
            background=BackgroundTask(upstream.aclose),
        )  # fmt: skip
