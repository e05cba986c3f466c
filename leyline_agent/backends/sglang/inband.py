"""The in-band splice on SGLang's HTTP server: ``POST /generate`` and ``/v1/chat/completions``
bodies that carry ``leyline_splice`` (the contract: ``leyline_agent/inband.py``).

An ASGI middleware of the main process (``InbandSplice``, added by ``routes.add_routes``; SGLang's
API-key middleware is added later, so it runs first and an unauthenticated request never
splices). Per request that carries the field:

1. The body is read whole; the field is removed and checked against the request's namespace
   (``inband.resolve``): invalid -> 400, nothing run.
2. The splice runs as ``POST /leyline/splice`` does (``routes.execute``: the tokenizer manager's
   communicator, the scheduler between batches, atomic with rollback), on the DP rank the request
   itself goes to (its ``routed_dp_rank``, else its namespace's home rank: ``dp.home_rank``, where
   ``plugin.pin_to_dp_rank`` sends it); with TP on every rank as any control request.
3. Refused or failed (any status but 200): the answer is that status when it is a 4xx, else 409,
   with the splice's own body and status (``x-leyline-splice-refused``); the request is not run.
4. Spliced: the request runs with the field removed, and its answer (plain or streamed) carries
   the ``SpliceResponse`` in ``x-leyline-splice``.

Every answer of the two routes (with the field or without) names this server in
``x-leyline-worker`` (``WORKER_ID``), so a client behind a gateway sees when it was moved.

Why here and not in the scheduler: the body field does not survive SGLang's request objects
(``TokenizedGenerateReqInput`` is a msgspec struct with fixed fields), and a streamed chat answer
starts its status line before the tokenizer manager sees the request; only the HTTP layer can
answer a refused edit with a 4xx on both routes. The splice and the request then reach the
scheduler in that order over the same socket; between them the scheduler may run other batches,
which can evict the spliced sequence only as they can evict any cached prefix (a cache miss for
that request, never wrong KV).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from leyline_agent.inband import (
    FIELD,
    REFUSED_HEADER,
    RESULT_HEADER,
    ROUTES,
    WORKER_HEADER,
    InbandError,
    resolve,
)

#: This server's id in ``x-leyline-worker`` (new at every start: a restarted worker holds nothing).
WORKER_ID = uuid.uuid4().hex[:16]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def _read(receive: Receive) -> bytes:
    chunks = []
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            break
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body read once, then the client's own channel.

    NOTE: not an immediate ``http.disconnect``: SGLang polls ``request.is_disconnected()`` while
    a request runs and aborts it on one (a /generate taking over a few seconds answered 400
    "Request is disconnected from the client side"; its start-up warm-up failed on a loaded
    host). After the body, the client's channel blocks until the client really disconnects."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _answer(send: Send, status: int, body: Any, headers: dict[str, str]) -> None:
    raw = json.dumps(body).encode()
    pairs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    pairs += [(k.encode(), v.encode()) for k, v in {**headers, WORKER_HEADER: WORKER_ID}.items()]
    await send({"type": "http.response.start", "status": status, "headers": pairs})
    await send({"type": "http.response.body", "body": raw})


class InbandSplice:
    """ASGI middleware: the in-band splice of the module docstring; every other request passes
    through untouched."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in ROUTES:
            await self.app(scope, receive, send)
            return
        raw = await _read(receive)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict) or FIELD not in body:  # SGLang answers as usual
            await self.app(scope, _replay(raw, receive), _with_headers(send, {}))
            return
        value = body.pop(FIELD)
        try:
            req = resolve(value, body)
        except InbandError as e:
            await _answer(send, 400, {"error": str(e)}, {REFUSED_HEADER: "400"})
            return
        status, result = await _splice(req, body)
        if status != 200:
            out = status if 400 <= status < 500 else 409
            if isinstance(result, dict):
                result = {**result, "request": "not run: its in-band splice was refused"}
            await _answer(send, out, result, {REFUSED_HEADER: str(status)})
            return
        raw = json.dumps(body).encode()
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(raw)).encode())]}
        header = json.dumps(result, separators=(",", ":"))
        await self.app(scope, _replay(raw, receive), _with_headers(send, {RESULT_HEADER: header}))


def _with_headers(send: Send, headers: dict[str, str]) -> Send:
    """``send`` with ``headers`` and ``x-leyline-worker`` added to the response start."""
    extra = [(k.encode(), v.encode()) for k, v in {**headers, WORKER_HEADER: WORKER_ID}.items()]

    async def wrapped(msg: Message) -> None:
        if msg["type"] == "http.response.start":
            msg = {**msg, "headers": [*msg.get("headers", []), *extra]}
        await send(msg)

    return wrapped


async def _splice(req: Any, body: dict[str, Any]) -> tuple[int, Any]:
    """Run ``req`` on the DP rank the request goes to (module docstring, step 2)."""
    from leyline_agent.backends.sglang.dp import home_rank
    from leyline_agent.backends.sglang.routes import _dp_size, _tokenizer_manager, execute

    n = _dp_size(_tokenizer_manager())
    if n > 1 and req.dp_rank is None:
        rank = home_rank(body.get("extra_key"), body.get("cache_salt") or None, n)
        req = req.model_copy(update={"dp_rank": rank})
    return await execute("splice", req)
