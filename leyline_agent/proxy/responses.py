"""The proxy's own answers: OpenAI-style errors, SGLang-style refusals, the backend's as is."""

from __future__ import annotations

from collections.abc import Mapping

import httpx
from fastapi import Response
from fastapi.responses import JSONResponse


def error_response(
    status: int, message: str, kind: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """An OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``, the same
    ``error`` object as ``backend_error``'s (which adds SGLang's top-level fields)."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


def backend_error(
    status: int, message: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """An error body in SGLang's own format (what the backend would have answered), with the
    same message in OpenAI's ``error`` object too (what OpenAI clients read)."""
    body = {"object": "error", "message": message, "type": "BadRequest", "param": None}
    openai = {"message": message, "type": "invalid_request_error", "param": None, "code": status}
    return JSONResponse(
        {**body, "code": status, "error": openai}, status_code=status, headers=dict(headers or {})
    )


def passthrough(r: httpx.Response, headers: Mapping[str, str] | None = None) -> Response:
    """The backend's answer, status and content type unchanged."""
    media = r.headers.get("content-type", "application/json")
    return Response(r.content, status_code=r.status_code, media_type=media, headers=headers)


def unreachable(
    backend_url: str, e: httpx.HTTPError, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """504 for a backend that timed out, 502 for one that cannot be reached."""
    if isinstance(e, httpx.TimeoutException) and not isinstance(e, httpx.ConnectTimeout):
        return error_response(
            504, f"backend {backend_url} timed out: {e!r}", "backend_timeout", headers
        )
    return error_response(
        502, f"backend {backend_url} unreachable: {e!r}", "backend_unavailable", headers
    )


def backend_message(r: httpx.Response) -> str:
    """The message of a backend's (read) error answer: SGLang's ``message``, else its text."""
    try:
        body = r.json()
    except ValueError:
        return r.text
    message = body.get("message") if isinstance(body, dict) else None
    return message if isinstance(message, str) and message else r.text
