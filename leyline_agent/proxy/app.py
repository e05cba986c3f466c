"""The OpenAI-compatible proxy: ``create_app(backend_url, policy)`` returns the FastAPI app.

``POST /v1/chat/completions`` runs one turn of a session (``chat.py`` over ``chat_turn.py``, the
same turn core as ``LeylineSession``; ``SessionCore`` under both and ``leyline replay``). The answer is the backend's, with
``usage.prompt_tokens_details.cached_tokens`` always present and an ``X-Leyline-Session`` header
naming the session. Streaming asks the backend for the usage chunk and drops it again when the
client did not ask for it (``relay.py``); other chunks pass through unchanged.

Errors (``responses.py``): a backend that cannot be reached answers 502 (connect timeout
``connect_timeout`` seconds), one that times out 504, a backend error status is passed through; a
request the policy or the chat template rejects answers 400. A request the backend is certain to
refuse (bad ``messages``, a prompt past the context length read once from ``/v1/models``) is
refused before any splice, with a 400 in the backend's own error format. A failed splice is not an
error (``SessionCore`` forwards anyway and records ``splice_error``).

Keys (``api_keys``, ``proxy/auth.py``): every route but ``/health`` then needs a client key
(401 otherwise, before anything else runs); the key's tenant scopes the session, its namespace and
the listings. ``backend_api_key`` is sent upstream on every request.

Several backends (``backends.py``): each session is pinned to one by rendezvous hashing of its
namespace, fails over to the next one up when its own is down, and ``/health`` of every backend
is polled each ``health_interval`` seconds.

Sharing (``share_exact``, default on): a session's requests use its tenant's shared namespace
until its first splice, then its own (``placement.py``). Pins and forks: ``retention.py``.

``POST /v1/responses`` and ``GET``/``DELETE /v1/responses/{id}``: the Responses API over the same
turn (``openai_responses.py``); ``POST /v1/messages`` and ``/v1/messages/count_tokens``:
Anthropic's Messages API (``anthropic_messages.py``). Other routes: ``GET /v1/models`` (forwarded), ``GET /leyline/sessions``,
``GET /leyline/sessions/{id}``, ``DELETE /leyline/sessions/{id}`` (end a session: its pins are
released; 409 while a turn is in flight), ``GET /metrics`` (Prometheus text), ``GET /health``;
every other route is forwarded to the backend as is (``LeylineProxy.forward``: completions in the
tenant's shared namespace, ``/v1/models/{id}``, ...), so the backend's own 404 answers what it
does not serve.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from leyline_agent.chat.model_dir import load_renderer
from leyline_agent.policies import Policy, parse_policy
from leyline_agent.proxy import metrics
from leyline_agent.proxy.anthropic_messages import add_routes as add_message_routes
from leyline_agent.proxy.auth import ApiKeys, AuthMiddleware, tenant_of
from leyline_agent.proxy.backends import DEFAULT_HEALTH_INTERVAL, BackendPool
from leyline_agent.proxy.chat import chat_completions
from leyline_agent.proxy.forward import forward
from leyline_agent.proxy.identity import SessionKey, public_ids
from leyline_agent.proxy.openai_responses import add_routes as add_response_routes
from leyline_agent.proxy.response_store import ResponseStore
from leyline_agent.proxy.responses import error_response, passthrough, unreachable
from leyline_agent.proxy.retention import Retention
from leyline_agent.proxy.session_record import FIELD_NOTES
from leyline_agent.proxy.sessions import ProxySession, SessionRegistry
from leyline_agent.session import SessionCore
from leyline_agent.traces.recorder import TraceRecorder
from leyline_agent.wrapper import ConversationWrapper

SESSIONS_ROUTE = "/leyline/sessions/"


class LeylineProxy:
    """State and handlers of one proxy app (see the module docstring)."""

    def __init__(
        self,
        backend_url: str | Sequence[str],
        policy: Policy,
        *,
        splice: bool,
        record_dir: str | Path | None,
        model_path: str | Path | None,
        max_sessions: int,
        connect_timeout: float,
        timeout: float,
        backend_api_key: str | None = None,
        share_exact: bool = True,
        gateway: bool | None = None,
    ) -> None:
        urls = [backend_url] if isinstance(backend_url, str) else list(backend_url)
        if gateway is True and len(urls) != 1:
            raise ValueError("a gateway is one backend URL (it routes to the workers itself)")
        limits = httpx.Timeout(timeout, connect=connect_timeout)
        self.pool = BackendPool(urls, timeout=limits, api_key=backend_api_key, gateway=gateway)
        # the first backend's: /v1/models and the context length (every backend serves one model)
        self.backend_url = self.pool.first.url
        self.client, self.http = self.pool.first.client, self.pool.first.http
        self.renderer = renderer = load_renderer(model_path)

        def new_core(key: SessionKey, cache_salt: str | None) -> SessionCore:
            wrapper = ConversationWrapper(renderer, policy)
            # NOTE: the client is the session's backend, bound by BackendPool.route on its first
            # turn
            return SessionCore(
                self.client, wrapper, session_id=key.public_id, namespace=key.namespace,
                splice=splice, cache_salt=cache_salt, share_exact=share_exact,
                shared_namespace=key.shared_namespace,
            )  # fmt: skip

        self.retention = Retention()
        self.registry = SessionRegistry(
            new_core, max_sessions=max_sessions, on_drop=self.retention.release_session
        )
        self.recorder = TraceRecorder(record_dir) if record_dir is not None else None
        self.parity = metrics.ParityCounters()
        self.routes = metrics.RouteCounters()
        self.responses = ResponseStore()  # stored Responses-API responses (openai_responses.py)
        self._context_len: int | None = None

    async def context_len(self) -> int | None:
        """The backend's context length (``max_model_len`` of ``GET /v1/models``), read once;
        None while the backend does not say."""
        if self._context_len is None:
            try:
                r = await self.http.get("/v1/models")
                data = r.json().get("data") or [{}]
                value = data[0].get("max_model_len")
                self._context_len = value if isinstance(value, int) and value > 0 else None
            except (httpx.HTTPError, ValueError, AttributeError):
                return None
        return self._context_len

    async def aclose(self) -> None:
        await self.retention.release_all(self.registry.sessions())  # NOTE: before the pool closes
        await self.http.aclose()
        await self.pool.aclose()

    async def chat_completions(self, request: Request) -> Response:
        return await chat_completions(self, request)

    async def models(self) -> Response:
        """The first backend's ``GET /v1/models``; while it is down, another's that is up."""
        others = [(b.url, b.http) for b in self.pool.up() if b.url != self.backend_url]
        first: tuple[str, httpx.HTTPError] | None = None
        for url, http in [(self.backend_url, self.http), *others]:
            try:
                return passthrough(await http.get("/v1/models"))
            except httpx.HTTPError as e:
                first = first or (url, e)
        assert first is not None  # the loop ran at least once
        return unreachable(*first)

    def sessions(self, request: Request) -> dict[str, Any]:
        tenant = tenant_of(request)  # a caller sees its own tenant only
        return {
            "backend": self.backend_url,
            "backends": self.pool.urls,
            "tenant": tenant,
            "sessions": [s.summary() for s in self.registry.sessions(tenant)],
            "totals": self.registry.totals(tenant).as_dict(),
            "notes": FIELD_NOTES,
        }

    def find_session(self, request: Request, session_id: str) -> ProxySession | Response:
        """The live session of the caller's tenant that ``/leyline/sessions/{id}`` names, else
        a 404 naming the ids tried: the path's segment as sent (the server percent-decodes the
        path once, so a listed id ``a%3Ab`` arrives as ``a:b``), then ``public_ids`` of the
        decoded one (``a%253Ab`` -> ``a%3Ab``; ``a:b``, the name as sent in
        ``X-Leyline-Session``, -> ``a%3Ab``)."""
        raw = request.scope.get("raw_path") or b""
        sent = raw.decode("latin-1").partition(SESSIONS_ROUTE)[2]
        ids = [i for i in dict.fromkeys([sent, *public_ids(session_id)]) if i]
        s = self.registry.find(ids, tenant_of(request))
        if s is None:
            tried = ", ".join(repr(i) for i in ids)
            return error_response(
                404, f"no live session {session_id!r} (tried the ids {tried})", "not_found"
            )
        return s

    def session(self, request: Request, session_id: str) -> Response:
        s = self.find_session(request, session_id)
        return s if isinstance(s, Response) else JSONResponse(s.detail())

    async def end_session(self, request: Request, session_id: str) -> Response:
        """``DELETE /leyline/sessions/{id}``: drop the session (its counters stay in the
        totals) and release its pins."""
        s = self.find_session(request, session_id)
        if isinstance(s, Response):
            return s
        if s.lock.locked():
            return error_response(409, f"session {s.id!r} has a turn in flight", "conflict")
        self.registry.remove(s)
        return JSONResponse({"id": s.id, "ended": True})

    async def forward(self, request: Request, path: str) -> Response:
        """Any route the proxy does not handle itself (``forward.py``)."""
        return await forward(self.pool, request, path, self.routes)

    def metrics(self, request: Request) -> Response:
        text = metrics.render(self.registry, self.parity, tenant=tenant_of(request))
        text += metrics.render_backends(self.pool, self.registry.sessions())
        text += metrics.render_retention(self.retention.counters)
        text += metrics.render_routes(self.routes)
        return Response(text, media_type=metrics.CONTENT_TYPE)


def create_app(
    backend_url: str | Sequence[str],
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
    health_interval: float = DEFAULT_HEALTH_INTERVAL,
    share_exact: bool = True,
    gateway: bool | None = None,
) -> FastAPI:
    """The proxy app in front of ``backend_url`` (a ``leyline serve``, without ``/v1``), or of
    several (a list of URLs; sessions routed by namespace, see ``backends.py``).

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
        health_interval: seconds between two polls of every backend's ``/health``.
        share_exact: sessions use their tenant's shared namespace until their first splice
            (False: each its own namespace from the first request, as before sharing).
        gateway: ``backend_url`` is one gateway (``smg``) in front of the workers: every request
            carries the session's routing key and its edits in-band (``gateway.py``,
            docs/scale-out.md); None (default): found out from the backend
            (``LeylineClient.gateway``).

    Raises:
        PolicyError: an unknown policy or bad policy parameters.
        FileNotFoundError, ValueError: ``model_path`` has no tokenizer or chat template; an
            empty API key or one key given for two tenants; no backend, or one given twice.
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
        share_exact=share_exact,
        gateway=gateway,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        health = asyncio.create_task(proxy.pool.run_health_checks(health_interval))
        try:
            yield
        finally:
            health.cancel()
            with suppress(asyncio.CancelledError):
                await health
            await proxy.aclose()

    app = FastAPI(title="Leyline proxy", lifespan=lifespan)
    app.state.proxy = proxy
    app.add_middleware(AuthMiddleware, keys=keys)
    app.add_api_route("/v1/chat/completions", proxy.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", proxy.models, methods=["GET"])
    app.add_api_route("/leyline/sessions", proxy.sessions, methods=["GET"])
    # NOTE: ":path": a listed id holds no "/", but the decoded one may (``a%2Fb`` -> ``a/b``)
    app.add_api_route(SESSIONS_ROUTE + "{session_id:path}", proxy.session, methods=["GET"])
    app.add_api_route(SESSIONS_ROUTE + "{session_id:path}", proxy.end_session, methods=["DELETE"])
    app.add_api_route("/metrics", proxy.metrics, methods=["GET"])
    app.add_api_route("/health", lambda: {"status": "ok"}, methods=["GET"])
    add_response_routes(app, proxy)
    add_message_routes(app, proxy)
    # NOTE: last: every route the proxy does not handle itself goes to the backend as is
    methods = ["GET", "POST", "PUT", "PATCH", "DELETE"]
    app.add_api_route("/{path:path}", proxy.forward, methods=methods)
    return app
