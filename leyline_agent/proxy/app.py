"""The OpenAI-compatible proxy: ``create_app(backend_url, policy)`` returns the FastAPI app.

Per ``POST /v1/chat/completions``::

    session = registry.resolve(...)                  # header, user, longest message prefix, new
    async with session.lock:                         # one turn of a session at a time
        pending = core.begin(messages, tools)        # policy, diff, /leyline/splice (a thread)
        forward core.chat_body(pending, body)        # edited messages, extra_key = namespace
        core.finish(pending, prompt, cached, ...)    # usage from the backend's answer

``SessionCore`` is the same code path as ``LeylineSession`` and ``leyline replay``. The answer is
the backend's, with ``usage.prompt_tokens_details.cached_tokens`` always present and an
``X-Leyline-Session`` header naming the session. Streaming asks the backend for the usage chunk
(``stream_options.include_usage``) and drops it again when the client did not ask for it; other
chunks pass through unchanged.

Errors: a backend that cannot be reached answers 502 (connect timeout ``connect_timeout``
seconds), one that times out 504, a backend error status is passed through; a request the policy
or the chat template rejects answers 400. A failed splice is not an error (``SessionCore``
forwards anyway and records ``splice_error``).

Keys (``api_keys``, ``proxy/auth.py``): every route but ``/health`` then needs a client key
(401 otherwise, before anything else runs); the key's tenant scopes the session, its namespace and
the listings. ``backend_api_key`` is sent upstream on every request.

Other routes: ``GET /v1/models`` (forwarded), ``GET /leyline/sessions``,
``GET /leyline/sessions/{id}``, ``GET /metrics`` (Prometheus text), ``GET /health``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import jinja2
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from leyline_agent.client import LeylineClient, auth_headers
from leyline_agent.directive import DirectiveError
from leyline_agent.policies import Policy, PolicyError, parse_policy
from leyline_agent.proxy import metrics
from leyline_agent.proxy.auth import ApiKeys, AuthMiddleware, tenant_of
from leyline_agent.proxy.sessions import (
    SESSION_HEADER,
    ProxySession,
    SessionRegistry,
    TraceRecorder,
)
from leyline_agent.render import load_renderer
from leyline_agent.session import Pending, SessionCore, chat_request_view, read_usage
from leyline_agent.wrapper import ConversationWrapper

log = logging.getLogger(__name__)


def error_response(
    status: int, message: str, kind: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """An OpenAI-style error body."""
    body = {"error": {"message": message, "type": kind, "code": status}}
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


def _passthrough(r: httpx.Response, headers: Mapping[str, str] | None = None) -> Response:
    media = r.headers.get("content-type", "application/json")
    return Response(r.content, status_code=r.status_code, media_type=media, headers=headers)


class LeylineProxy:
    """State and handlers of one proxy app (see the module docstring)."""

    def __init__(
        self,
        backend_url: str,
        policy: Policy,
        *,
        splice: bool,
        record_dir: str | Path | None,
        model_path: str | Path | None,
        max_sessions: int,
        connect_timeout: float,
        timeout: float,
        backend_api_key: str | None = None,
    ) -> None:
        self.backend_url = backend_url.rstrip("/")
        limits = httpx.Timeout(timeout, connect=connect_timeout)
        self.client = LeylineClient(self.backend_url, timeout=timeout, api_key=backend_api_key)
        self.client.http.timeout = limits
        self.http = httpx.AsyncClient(
            base_url=self.backend_url, timeout=limits, headers=auth_headers(backend_api_key)
        )
        renderer = load_renderer(model_path)

        def new_core(session_id: str, namespace: str) -> SessionCore:
            wrapper = ConversationWrapper(renderer, policy)
            return SessionCore(
                self.client, wrapper, session_id=session_id, namespace=namespace, splice=splice
            )

        self.registry = SessionRegistry(new_core, max_sessions=max_sessions)
        self.recorder = TraceRecorder(record_dir) if record_dir is not None else None

    async def aclose(self) -> None:
        await self.http.aclose()
        self.client.close()

    def _unreachable(
        self, e: httpx.HTTPError, headers: Mapping[str, str] | None = None
    ) -> JSONResponse:
        if isinstance(e, httpx.TimeoutException) and not isinstance(e, httpx.ConnectTimeout):
            return error_response(
                504, f"backend {self.backend_url} timed out: {e!r}", "backend_timeout", headers
            )
        return error_response(
            502, f"backend {self.backend_url} unreachable: {e!r}", "backend_unavailable", headers
        )

    def _finish(
        self,
        session: ProxySession,
        pending: Pending,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None,
        usage_holder: dict[str, Any],
        *,
        request_ms: float,
        ttft_ms: float | None = None,
    ) -> None:
        prompt, cached = read_usage(usage_holder, len(pending.plan.tokens))
        record = session.core.finish(
            pending,
            prompt_tokens=prompt,
            cached_tokens=cached,
            request_ms=request_ms,
            ttft_ms=ttft_ms,
            messages=messages,
        )
        if self.recorder is not None:
            self.recorder.write(session.key, record.turn, messages, tools)
        if prompt != len(pending.plan.tokens) and not session.warned:
            session.warned = True
            log.warning(
                "session %s: the backend's prompt has %d tokens, Leyline rendered %d; the chat "
                "template or tokenizer differs from the backend's (--model-path), so splices "
                "will miss",
                session.id, prompt, len(pending.plan.tokens),
            )  # fmt: skip

    async def chat_completions(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "the request body is not JSON", "invalid_request_error")
        messages = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(messages, list) or not messages:
            return error_response(
                400, "'messages' must be a non-empty list", "invalid_request_error"
            )
        tools = body.get("tools") or None
        user = body.get("user")
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            return error_response(400, "'cache_salt' must be a string", "invalid_request_error")
        session = self.registry.resolve(
            messages,
            header=request.headers.get(SESSION_HEADER),
            user=user if isinstance(user, str) and user else None,
            tenant=tenant_of(request),
            cache_salt=salt,
        )
        headers = {SESSION_HEADER: session.id}
        await session.lock.acquire()
        handed_over = False  # the streaming relay releases the lock when it ends
        try:
            session.core.set_cache_salt(salt)  # one namespace (extra_key, cache_salt) per turn
            try:
                view = chat_request_view(messages, tools, body.get("tool_choice"))
                pending = await anyio.to_thread.run_sync(session.core.begin, *view)
            except (PolicyError, DirectiveError, jinja2.TemplateError) as e:
                return error_response(
                    400, f"cannot apply the policy: {e}", "invalid_request_error", headers
                )
            forward = session.core.chat_body(pending, body)
            t0 = time.perf_counter()
            if body.get("stream"):
                want_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                forward["stream_options"] = {
                    **(body.get("stream_options") or {}),
                    "include_usage": True,
                }
                req = self.http.build_request("POST", "/v1/chat/completions", json=forward)
                upstream = await self.http.send(req, stream=True)
                if upstream.status_code != 200:
                    await upstream.aread()
                    await upstream.aclose()
                    return _passthrough(upstream, headers)
                relay = self._relay(session, pending, upstream, messages, tools, want_usage, t0)
                handed_over = True
                return StreamingResponse(relay, media_type="text/event-stream", headers=headers)
            r = await self.http.post("/v1/chat/completions", json=forward)
            request_ms = (time.perf_counter() - t0) * 1e3
            if r.status_code != 200:
                return _passthrough(r, headers)
            data = r.json()
            self._finish(session, pending, messages, tools, data, request_ms=request_ms)
            return JSONResponse(data, headers=headers)
        except httpx.HTTPError as e:
            return self._unreachable(e, headers)
        finally:
            if not handed_over:
                session.lock.release()

    async def _relay(
        self,
        session: ProxySession,
        pending: Pending,
        upstream: httpx.Response,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None,
        want_usage: bool,
        t0: float,
    ) -> AsyncIterator[str]:
        """Pass the backend's SSE lines through; read (and maybe drop) the usage chunk."""
        usage: dict[str, Any] | None = None
        ttft_ms: float | None = None
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
                    if isinstance(chunk, dict) and chunk.get("usage"):
                        usage = {"usage": dict(chunk["usage"])}
                        if not chunk.get("choices"):  # the usage chunk
                            if not want_usage:
                                continue
                            read_usage(chunk, len(pending.plan.tokens))
                            line = "data: " + json.dumps(chunk, separators=(",", ":"))
                yield line + "\n"
        finally:
            try:
                if usage is not None:  # the backend answered in full
                    request_ms = (time.perf_counter() - t0) * 1e3
                    self._finish(
                        session, pending, messages, tools, usage,
                        request_ms=request_ms, ttft_ms=ttft_ms,
                    )  # fmt: skip
            finally:
                session.lock.release()
                with anyio.CancelScope(shield=True):
                    await upstream.aclose()

    async def models(self) -> Response:
        try:
            return _passthrough(await self.http.get("/v1/models"))
        except httpx.HTTPError as e:
            return self._unreachable(e)

    def sessions(self, request: Request) -> dict[str, Any]:
        tenant = tenant_of(request)  # a caller sees its own tenant only
        return {
            "backend": self.backend_url,
            "tenant": tenant,
            "sessions": [s.summary() for s in self.registry.sessions(tenant)],
            "totals": self.registry.totals(tenant).as_dict(),
        }

    def session(self, request: Request, session_id: str) -> Response:
        s = self.registry.get(session_id, tenant_of(request))
        if s is None:
            return error_response(404, f"no live session {session_id!r}", "not_found")
        return JSONResponse(s.detail())

    def metrics(self, request: Request) -> Response:
        text = metrics.render(self.registry, tenant=tenant_of(request))
        return Response(text, media_type=metrics.CONTENT_TYPE)


def create_app(
    backend_url: str,
    policy: Policy | str,
    *,
    splice: bool = True,
    record_dir: str | Path | None = None,
    model_path: str | Path | None = None,
    max_sessions: int = 1024,
    connect_timeout: float = 5.0,
    timeout: float = 600.0,
    api_keys: Sequence[str] | None = None,
    backend_api_key: str | None = None,
) -> FastAPI:
    """The proxy app in front of ``backend_url`` (a ``leyline serve``, without ``/v1``).

    Args:
        policy: a policy or a spec such as ``"stale_tool_outputs:keep_last=2"``.
        splice: False forwards the edited requests without directives (re-prefill).
        record_dir: write every turn's incoming messages there (see ``TraceRecorder``).
        model_path: the model directory whose chat template the backend uses (None: embedded).
        max_sessions: live sessions kept (least recently used idle ones are dropped).
        connect_timeout, timeout: seconds to reach the backend, and for a whole request.
        api_keys: client keys, ``KEY`` or ``KEY=TENANT`` (see ``proxy/auth.py``); None or empty:
            no authentication, one tenant (``default``).
        backend_api_key: the backend's own key (``leyline serve --api-key``), sent upstream.

    Raises:
        PolicyError: an unknown policy or bad policy parameters.
        FileNotFoundError, ValueError: ``model_path`` has no tokenizer or chat template; an
            empty API key or one key given for two tenants.
    """
    keys = ApiKeys(api_keys or ())
    proxy = LeylineProxy(
        backend_url,
        parse_policy(policy),
        splice=splice,
        record_dir=record_dir,
        model_path=model_path,
        max_sessions=max_sessions,
        connect_timeout=connect_timeout,
        timeout=timeout,
        backend_api_key=backend_api_key,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.aclose()

    app = FastAPI(title="Leyline proxy", lifespan=lifespan)
    app.state.proxy = proxy
    app.add_middleware(AuthMiddleware, keys=keys)
    app.add_api_route("/v1/chat/completions", proxy.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", proxy.models, methods=["GET"])
    app.add_api_route("/leyline/sessions", proxy.sessions, methods=["GET"])
    app.add_api_route("/leyline/sessions/{session_id}", proxy.session, methods=["GET"])
    app.add_api_route("/metrics", proxy.metrics, methods=["GET"])
    app.add_api_route("/health", lambda: {"status": "ok"}, methods=["GET"])
    return app
