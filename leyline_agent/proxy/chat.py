"""``POST /v1/chat/completions`` through the proxy: one turn of a session.

Per request::

    session = registry.resolve(...)                  # header, user, longest message prefix, new
    async with session.lock:                         # one turn of a session at a time
        turn = chat_turn.prepare(core, body)         # checks, policy, diff, splice (a thread)
        forward turn.body                            # edited messages, the request namespace
        chat_turn.complete(core, turn, answer)       # usage from the backend's answer

Render parity: every forwarded request asks the backend for its prompt token ids
(``return_prompt_token_ids``: ``choices[i].prompt_token_ids`` in a plain answer; streams: see
``relay.py``). The proxy removes them again when the client did not ask. When they differ from the
rendered tokens the session adopts them (``SessionCore.finish``), counted in
``leyline_proxy_render_mismatches_total`` and ``leyline_proxy_resyncs_total``.

A turn whose splice ran is recorded (and written by ``--record``) even when the request after it
fails or the client disconnects mid-stream: the cache changed, so the session state did too.

Pins and forks (``retention.py``): a turn whose messages carry a ``cache_control`` marker pins
the marked prefix after it is recorded (a streamed one after its stream ended, before the
session's next turn); a new session's first request with ``X-Leyline-Fork-From: <id>`` starts from
that session: ``<id>`` is its public id or the name its client sent in ``X-Leyline-Session``
(``identity.public_ids``); 404 when neither is a live session of the caller's tenant, nothing
created.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

import anyio.to_thread
import httpx
import jinja2
from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from leyline_agent import gateway
from leyline_agent.accounting import TurnRecord
from leyline_agent.chat.request import may_hold_surrogates, request_error
from leyline_agent.chat_turn import ChatTurn, RequestRefused, complete, prepare
from leyline_agent.directive import DirectiveError
from leyline_agent.policies import Policy, PolicyError
from leyline_agent.proxy import fastjson
from leyline_agent.proxy.auth import tenant_of
from leyline_agent.proxy.backends import Backend
from leyline_agent.proxy.identity import FORK_HEADER, SESSION_HEADER, public_ids, session_keys
from leyline_agent.proxy.relay import StreamEnd, relay
from leyline_agent.proxy.responses import backend_error, error_response, passthrough, unreachable
from leyline_agent.proxy.sessions import ProxySession

if TYPE_CHECKING:
    from leyline_agent.proxy.app import LeylineProxy

log = logging.getLogger(__name__)


class ProxyTurn:
    """One request's session and prepared chat turn (``chat_turn.ChatTurn``), and how the
    proxy records it (parity counters, ``--record``, the render-mismatch warning)."""

    def __init__(
        self, proxy: LeylineProxy, session: ProxySession, turn: ChatTurn, route: str
    ) -> None:
        self.proxy, self.session, self.turn, self.route = proxy, session, turn, route

    def finish(
        self,
        data: dict[str, Any] | None,
        *,
        request_ms: float,
        ttft_ms: float | None = None,
        prompt_ids: list[int] | None = None,
        error: str | None = None,
    ) -> TurnRecord:
        """Record the turn (``chat_turn.complete``). ``data`` None: the request failed or was
        cut off after reaching the backend (``error``); recorded with what is known."""
        session, turn = self.session, self.turn
        record = complete(
            session.core, turn, data, request_ms=request_ms, ttft_ms=ttft_ms,
            prompt_ids=prompt_ids, error=error,
        )  # fmt: skip
        self.proxy.parity.add(record)
        self.proxy.routes.turn(self.route, record)
        if self.proxy.recorder is not None:
            self.proxy.recorder.write(session.key, record.turn, turn.messages, turn.tools)
        if record.render_mismatch and not session.warned:
            session.warned = True
            log.warning(
                "session %s: the backend's prompt (%d tokens) differs from the one Leyline "
                "rendered (%d); the chat template or tokenizer differs from the backend's "
                "(--model-path). The session follows the backend's tokens (resynced: %s)",
                session.id, record.prompt_tokens, len(turn.pending.plan.tokens), record.resynced,
            )  # fmt: skip
        return record

    def failed(self, t0: float, error: int | str) -> None:
        """A request that failed after ``prepare``: recorded only when its splice ran (the
        cache, hence the session, changed)."""
        if self.turn.pending.committed:
            request_ms = (time.perf_counter() - t0) * 1e3
            error = f"backend status {error}" if isinstance(error, int) else error
            self.finish(None, request_ms=request_ms, error=error)

    def stream_ended(self, end: StreamEnd) -> None:
        """The end of a relayed stream: record the turn, then (after its pin, when marked)
        release the session."""
        pinning = False
        try:
            record = self.finish(
                end.usage, request_ms=end.request_ms, ttft_ms=end.ttft_ms,
                prompt_ids=end.prompt_ids, error=end.error,
            )  # fmt: skip
            markers = self.turn.markers
            if markers and record.error is None:
                retention = self.proxy.retention
                pending = self.turn.pending
                retention.spawn(retention.pin_then_release(self.session, pending, markers))
                pinning = True
        finally:
            if not pinning:
                self.session.lock.release()


class ChatView:
    """The response view of ``POST /v1/chat/completions``: the backend's answers as they are.
    Another front door (``openai_responses.py``) answers in its own format through the same
    ``serve_turn`` by giving its own view with these five methods (and its ``route``, the label
    of its ``/metrics`` counters)."""

    route = "/v1/chat/completions"
    policy: Policy | None = None  # this request's own edits after the session's policy
    fit_budget = False  # max_tokens is a cap to fit the context (chat_turn.prepare)

    def error(self, status: int, message: str, kind: str, headers: Mapping[str, str]) -> Response:
        """The proxy's own refusal (bad session reference, a policy that cannot apply)."""
        return error_response(status, message, kind, headers)

    def refused(self, message: str, headers: Mapping[str, str]) -> Response:
        """What the backend would have answered (400), found before any splice."""
        return backend_error(400, message, headers)

    def backend_failed(self, r: httpx.Response, headers: Mapping[str, str]) -> Response:
        """The backend's error answer (read)."""
        return passthrough(r, headers)

    def answer(self, data: dict[str, Any], turn: ChatTurn, headers: Mapping[str, str]) -> Response:
        return JSONResponse(data, headers=dict(headers))

    def stream(
        self, lines: AsyncIterator[str], turn: ChatTurn, headers: Mapping[str, str]
    ) -> Response:
        """The relayed chat SSE lines (``relay.py``)."""
        return StreamingResponse(lines, media_type="text/event-stream", headers=dict(headers))


async def _post(
    backend: Backend, session: ProxySession, turn: ChatTurn, *, stream: bool
) -> httpx.Response:
    """The turn's chat request (``stream``: its body not read yet). Behind a gateway
    (``--gateway``) with the session's routing key; an in-band splice the worker refused
    (``gateway.settle``: a counted miss, the request not run) is sent again without it."""
    gw, core = backend.client.gateway, session.core
    headers = gateway.routing_headers(core) if gw else None
    while True:
        req = backend.http.build_request(
            "POST", "/v1/chat/completions", content=fastjson.dumps(turn.body),
            headers={**(headers or {}), "content-type": "application/json"},
        )  # fmt: skip
        r = await backend.http.send(req, stream=stream)
        if not gw:
            return r
        data = None
        if r.status_code != 200:
            await r.aread()
            try:
                data = r.json()
            except ValueError:
                data = None
        if not gateway.settle(core, turn.pending, turn.edit, r.status_code, r.headers, data):
            return r
        await r.aclose()
        turn.body, turn.edit = gateway.without_edit(core, turn.body), None


async def chat_completions(proxy: LeylineProxy, request: Request) -> Response:
    """``POST /v1/chat/completions``: the body, then ``serve_turn`` with the chat view."""
    raw = await request.body()
    try:
        body = fastjson.loads(raw)
    except ValueError:
        return error_response(400, "the request body is not JSON", "invalid_request_error")
    return await serve_turn(proxy, request, body, ChatView(), raw=raw)


async def serve_turn(
    proxy: LeylineProxy, request: Request, body: Any, view: ChatView, raw: bytes | None = None
) -> Response:
    """One turn of a chat-completions ``body`` (see the module docstring), answered through
    ``view``; errors as ``app.py`` describes. The turn goes to the session's backend
    (``BackendPool.route``); one that cannot be connected to is marked down and the turn is
    planned again on the session's next backend (failover), until none is up. ``raw``: the
    body's JSON bytes, when ``body`` is the client's own (its text is then checked only where
    they may hold a surrogate: ``may_hold_surrogates``)."""
    proxy.routes.request(view.route)
    refused = request_error(body, text=raw is None or may_hold_surrogates(raw))
    if refused is not None:
        return view.refused(refused, {})
    messages = body["messages"]
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        return view.error(400, "'cache_salt' must be a string", "invalid_request_error", {})
    context_len = await proxy.context_len()
    keys = session_keys(body, request.headers)._asdict()  # header > prompt_cache_key > user
    tenant = tenant_of(request)
    parent = None
    fork_from = request.headers.get(FORK_HEADER)
    if fork_from:
        tried = public_ids(fork_from)
        parent = proxy.registry.find(tried, tenant)
        existing = proxy.registry.named(**keys, tenant=tenant)
        if existing is not None and (existing.core.records or existing.forked_from):
            parent = None  # NOTE: read on a session's first request only
        elif parent is None:
            ids = ", ".join(repr(i) for i in tried)
            missing = f"no live session {fork_from!r} to fork from (tried the ids {ids})"
            return view.error(404, f"{FORK_HEADER}: {missing}", "not_found", {})
        elif parent is existing:
            itself = f"{FORK_HEADER}: a session cannot fork from itself"
            return view.error(400, itself, "invalid_request_error", {})
    session = proxy.registry.resolve(
        messages, **keys, tenant=tenant, cache_salt=salt,
        fresh=parent is not None,
    )  # fmt: skip
    headers = {SESSION_HEADER: session.id}
    await session.lock.acquire()
    if parent is not None and not session.core.records and session.forked_from is None:
        await proxy.retention.fork_session(parent, session, salt)
    handed_over = False  # the streaming relay releases the lock when it ends
    turn: ProxyTurn | None = None
    t0 = time.perf_counter()

    async def forward_turn(backend: Backend) -> Response:
        nonlocal turn, t0, handed_over
        try:
            prepared = await anyio.to_thread.run_sync(
                lambda: prepare(
                    session.core,
                    body,
                    context_len=context_len,
                    policy=view.policy,
                    fit_budget=view.fit_budget,
                )
            )
        except (RequestRefused, jinja2.TemplateError) as e:  # what the backend would say
            return view.refused(str(e), headers)
        except (PolicyError, DirectiveError) as e:
            return view.error(
                400, f"cannot apply the policy: {e}", "invalid_request_error", headers
            )
        turn = ProxyTurn(proxy, session, prepared, view.route)
        pending, markers = prepared.pending, prepared.markers
        t0 = time.perf_counter()
        if body.get("stream"):
            upstream = await _post(backend, session, prepared, stream=True)
            backend.count(error=upstream.status_code >= 500)
            if upstream.status_code != 200:
                await upstream.aread()
                await upstream.aclose()
                turn.failed(t0, upstream.status_code)
                return view.backend_failed(upstream, headers)
            lines = relay(
                upstream,
                prompt_len=len(pending.plan.tokens),
                want_usage=bool((body.get("stream_options") or {}).get("include_usage")),
                want_ids=bool(body.get("return_input_ids_in_sglext")),
                t0=t0,
                on_end=turn.stream_ended,
            )
            handed_over = True
            return view.stream(lines, prepared, headers)
        r = await _post(backend, session, prepared, stream=False)
        backend.count(error=r.status_code >= 500)
        request_ms = (time.perf_counter() - t0) * 1e3
        if r.status_code != 200:
            turn.failed(t0, r.status_code)
            return view.backend_failed(r, headers)
        data = fastjson.loads(r.content)
        record = turn.finish(data, request_ms=request_ms, prompt_ids=prepared.prompt_ids(data))
        if markers and record.error is None:
            await proxy.retention.pin_turn(session, pending, markers)
        return view.answer(data, prepared, headers)

    try:
        backend = proxy.pool.route(session)
        tries = len(proxy.pool.urls)
        while True:
            try:
                return await forward_turn(backend)
            except httpx.ConnectError as e:  # NOTE: nothing reached the backend: safe to redo
                backend.count(error=True)
                proxy.pool.mark_down(backend, e)
                tries -= 1
                if tries == 0 or not proxy.pool.up():
                    raise
                if turn is not None:
                    turn.failed(t0, repr(e))
                    turn = None
                backend = proxy.pool.route(session)
    except httpx.HTTPError as e:
        if not isinstance(e, httpx.ConnectError):
            backend.count(error=True)
        if turn is not None:
            turn.failed(t0, repr(e))
        return unreachable(backend.url, e, headers)
    finally:
        if not handed_over:
            session.lock.release()
