"""A streamed chat completion passed through: the backend's SSE lines, less what the proxy
asked for on its own behalf.

The proxy always asks the backend for the usage chunk (``stream_options.include_usage``) and for
the prompt ids (``return_input_ids_in_sglext``: ``sglext.input_ids`` in the chunk before the
usage chunk; SGLang refuses ``return_prompt_token_ids`` with ``stream``). Both are read here and
dropped again unless the client asked for them; other chunks pass through unchanged.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

import anyio
import httpx

from leyline_agent.chat.openai import read_usage


class StreamEnd(NamedTuple):
    """How a relayed stream ended: the usage chunk's ``{"usage": ...}`` (None: the stream ended
    before it), the prompt ids, the time to the first chunk and the whole request (ms), and the
    error when there was no usage (the client disconnected, the backend failed)."""

    usage: dict[str, Any] | None
    prompt_ids: list[int] | None
    ttft_ms: float | None
    request_ms: float
    error: str | None


def sglext_input_ids(chunk: dict[str, Any], keep: bool) -> tuple[list[int] | None, str | None]:
    """``(sglext.input_ids, the line to pass on)`` of a stream chunk: the line unchanged
    (``""``), rewritten without the ids (a JSON string), or dropped (None, a chunk left with
    nothing else). The ids are removed unless ``keep``."""
    ext = chunk.get("sglext")
    if chunk.get("choices") or not isinstance(ext, dict) or ext.get("input_ids") is None:
        return None, ""
    ids = ext["input_ids"]
    ids = list(ids) if isinstance(ids, list) else None
    if keep:
        return ids, ""
    ext["input_ids"] = None
    if all(v is None for v in ext.values()):
        return ids, None
    return ids, "data: " + json.dumps(chunk, separators=(",", ":"))


async def relay(
    upstream: httpx.Response,
    *,
    prompt_len: int,
    want_usage: bool,
    want_ids: bool,
    t0: float,
    on_end: Callable[[StreamEnd], None],
) -> AsyncIterator[str]:
    """Pass the backend's SSE lines through; read (and maybe drop) the usage chunk and the
    prompt ids (``want_*``: the client asked for them). ``on_end`` runs once however the stream
    ends (``prompt_len`` stands in for a usage chunk without ``prompt_tokens``); the upstream
    response is closed after it."""
    usage: dict[str, Any] | None = None
    ids: list[int] | None = None
    ttft_ms: float | None = None
    error = "client disconnected"
    try:
        async for line in upstream.aiter_lines():
            payload = line[5:].strip() if line.startswith("data:") else ""
            if payload and payload != "[DONE]":
                if ttft_ms is None:
                    ttft_ms = (time.perf_counter() - t0) * 1e3
                try:
                    chunk = json.loads(payload)
                except ValueError:
                    chunk = None
                if isinstance(chunk, dict) and chunk.get("sglext"):
                    found, rewritten = sglext_input_ids(chunk, want_ids)
                    ids = found if found is not None else ids
                    if rewritten is None:
                        continue
                    line = rewritten or line
                if isinstance(chunk, dict) and chunk.get("usage"):
                    usage = {"usage": dict(chunk["usage"])}
                    if not chunk.get("choices"):  # the usage chunk
                        if not want_usage:
                            continue
                        read_usage(chunk, prompt_len)
                        line = "data: " + json.dumps(chunk, separators=(",", ":"))
            yield line + "\n"
    except httpx.HTTPError as e:
        error = f"backend stream failed: {e!r}"
        raise
    finally:
        try:
            request_ms = (time.perf_counter() - t0) * 1e3
            on_end(StreamEnd(usage, ids, ttft_ms, request_ms, None if usage is not None else error))
        finally:
            with anyio.CancelScope(shield=True):
                await upstream.aclose()


async def chunks(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of relayed SSE lines (``relay``'s output), in order: what another API's
    stream view translates (``data: [DONE]``, blank and malformed lines skipped)."""
    async for line in lines:
        payload = line.strip()[5:].strip() if line.startswith("data:") else ""
        if not payload or payload == "[DONE]":
            continue
        try:
            chunk = json.loads(payload)
        except ValueError:
            continue
        if isinstance(chunk, dict):
            yield chunk
