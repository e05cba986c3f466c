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
or the chat template rejects answers 400. A request the backend is certain to refuse (bad
``messages``, a prompt past the context length read once from ``/v1/models``) is refused before
any splice, with a 400 in the backend's own error format. A failed splice is not an error
(``SessionCore`` forwards anyway and records ``splice_error``).

Render parity: every forwarded request asks the backend for its prompt token ids
(``return_prompt_token_ids``: ``choices[i].prompt_token_ids`` in a plain answer; SGLang refuses it
with ``stream``, so streams ask ``return_input_ids_in_sglext`` and read ``sglext.input_ids`` from
the chunk before the usage chunk). The proxy removes them again when the client did not ask. When
they differ from the rendered tokens the session adopts them (``SessionCore.finish``), counted in
``leyline_proxy_render_mismatches_total`` and ``leyline_proxy_resyncs_total``.

A turn whose splice ran is recorded (and written by ``--record``) even when the request after it
fails or the client disconnects mid-stream: the cache changed, so the session state did too.

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

from leyline_agent.chat.model_dir import load_renderer
from leyline_agent.chat.openai import chat_request_view, pop_prompt_ids, read_usage
from leyline_agent.chat.request import max_new_tokens, request_error, template_kwargs
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
from leyline_agent.session import Pending, RequestRefused, SessionCore, TurnRecord
from leyline_agent.wrapper import ConversationWrapper

log = logging.getLogger(__name__)


def error_response(
    status: int, message: str, kind: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """An OpenAI-style error body."""
    body = {"error": {"message": message, "type": kind, "code": status}}
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


def backend_error(
    status: int, message: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """An error body in SGLang's own format (what the backend would have answered)."""
    body = {"object": "error", "message": message, "type": "BadRequest", "param": None}
    return JSONResponse({**body, "code": status}, status_code=status, headers=dict(headers or {}))


def _sglext_input_ids(chunk: dict[str, Any], keep: bool) -> tuple[list[int] | None, str | None]:
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
        self.parity = metrics.ParityCounters()
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
        usage_holder: dict[str, Any] | None,
        *,
        request_ms: float,
        ttft_ms: float | None = None,
        prompt_ids: list[int] | None = None,
        error: str | None = None,
    ) -> TurnRecord:
        """Record the turn. ``usage_holder`` None: the request failed or was cut off after
        reaching the backend (``error``); recorded with what is known."""
        if usage_holder is not None:
            prompt, cached = read_usage(usage_holder, len(pending.plan.tokens))
        else:  # prefilled only if the backend sent a first token
            prompt, cached = (len(pending.plan.tokens) if ttft_ms is not None else 0), 0
        record = session.core.finish(
            pending,
            prompt_tokens=prompt,
            cached_tokens=cached,
            request_ms=request_ms,
            ttft_ms=ttft_ms,
            messages=messages,
            prompt_ids=prompt_ids,
            error=error,
            prefilled=usage_holder is not None or ttft_ms is not None,
        )
        self.parity.add(record)
        if self.recorder is not None:
            self.recorder.write(session.key, record.turn, messages, tools)
        if record.render_mismatch and not session.warned:
            session.warned = True
            log.warning(
                "session %s: the backend's prompt (%d tokens) differs from the one Leyline "
                "rendered (%d); the chat template or tokenizer differs from the backend's "
                "(--model-path). The session follows the backend's tokens (resynced: %s)",
                session.id, prompt, len(pending.plan.tokens), record.resynced,
            )  # fmt: skip
        return record

    async def chat_completions(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "the request body is not JSON", "invalid_request_error")
        refused = request_error(body)
        if refused is not None:
            return backend_error(400, refused)
        messages = body["messages"]
        tools = body.get("tools") or None
        user = body.get("user")
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            return error_response(400, "'cache_salt' must be a string", "invalid_request_error")
        context_len = await self.context_len()
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
        pending: Pending | None = None
        t0 = time.perf_counter()
        try:
            session.core.set_cache_salt(salt)  # one namespace (extra_key, cache_salt) per turn
            cont = bool(body.get("continue_final_message"))
            try:
                view = chat_request_view(messages, tools, body.get("tool_choice"), cont)
                pending = await anyio.to_thread.run_sync(
                    lambda: session.core.begin(
                        *view,
                        template_kwargs=template_kwargs(body),
                        continue_final=cont,
                        context_len=context_len,
                        max_new_tokens=max_new_tokens(body),
                    )
                )
            except (RequestRefused, jinja2.TemplateError) as e:  # what the backend would say
                return backend_error(400, str(e), headers)
            except (PolicyError, DirectiveError) as e:
                return error_response(
                    400, f"cannot apply the policy: {e}", "invalid_request_error", headers
                )
            forward = session.core.chat_body(pending, body)
            t0 = time.perf_counter()
            if body.get("stream"):
                want_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                want_ids = bool(body.get("return_input_ids_in_sglext"))
                forward["stream_options"] = {
                    **(body.get("stream_options") or {}),
                    "include_usage": True,
                }
                forward["return_input_ids_in_sglext"] = True
                req = self.http.build_request("POST", "/v1/chat/completions", json=forward)
                upstream = await self.http.send(req, stream=True)
                if upstream.status_code != 200:
                    await upstream.aread()
                    await upstream.aclose()
                    self._failed(session, pending, messages, tools, t0, upstream.status_code)
                    return _passthrough(upstream, headers)
                relay = self._relay(
                    session, pending, upstream, messages, tools, (want_usage, want_ids), t0
                )
                handed_over = True
                return StreamingResponse(relay, media_type="text/event-stream", headers=headers)
            forward["return_prompt_token_ids"] = True
            r = await self.http.post("/v1/chat/completions", json=forward)
            request_ms = (time.perf_counter() - t0) * 1e3
            if r.status_code != 200:
                self._failed(session, pending, messages, tools, t0, r.status_code)
                return _passthrough(r, headers)
            data = r.json()
            keep = bool(body.get("return_prompt_token_ids") or body.get("return_token_ids"))
            ids = pop_prompt_ids(data, keep=keep)
            self._finish(
                session, pending, messages, tools, data, request_ms=request_ms, prompt_ids=ids
            )
            return JSONResponse(data, headers=headers)
        except httpx.HTTPError as e:
            if pending is not None:
                self._failed(session, pending, messages, tools, t0, repr(e))
            return self._unreachable(e, headers)
        finally:
            if not handed_over:
                session.lock.release()

    def _failed(
        self,
        session: ProxySession,
        pending: Pending,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None,
        t0: float,
        error: int | str,
    ) -> None:
        """A request that failed after ``begin``: recorded only when its splice ran (the cache,
        hence the session, changed)."""
        if pending.committed:
            request_ms = (time.perf_counter() - t0) * 1e3
            error = f"backend status {error}" if isinstance(error, int) else error
            self._finish(
                session, pending, messages, tools, None, request_ms=request_ms, error=error
            )

    async def _relay(
        self,
        session: ProxySession,
        pending: Pending,
        upstream: httpx.Response,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None,
        want: tuple[bool, bool],
        t0: float,
    ) -> AsyncIterator[str]:
        """Pass the backend's SSE lines through; read (and maybe drop) the usage chunk and the
        prompt ids (``want``: the client asked for usage, for ``sglext.input_ids``).

        A stream that ends early (the client disconnected, the backend failed) is still
        recorded: the backend prefilled the prompt if it sent a first token."""
        want_usage, want_ids = want
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
                        found, rewritten = _sglext_input_ids(chunk, want_ids)
                        ids = found if found is not None else ids
                        if rewritten is None:
                            continue
                        line = rewritten or line
                    if isinstance(chunk, dict) and chunk.get("usage"):
                        usage = {"usage": dict(chunk["usage"])}
                        if not chunk.get("choices"):  # the usage chunk
                            if not want_usage:
                                continue
                            read_usage(chunk, len(pending.plan.tokens))
                            line = "data: " + json.dumps(chunk, separators=(",", ":"))
                yield line + "\n"
        except httpx.HTTPError as e:
            error = f"backend stream failed: {e!r}"
            raise
        finally:
            try:
                request_ms = (time.perf_counter() - t0) * 1e3
                self._finish(
                    session, pending, messages, tools, usage,
                    request_ms=request_ms, ttft_ms=ttft_ms, prompt_ids=ids,
                    error=None if usage is not None else error,
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
        text = metrics.render(self.registry, self.parity, tenant=tenant_of(request))
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
