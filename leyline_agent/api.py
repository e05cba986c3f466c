"""The in-process API for Python agent loops: ``LeylineSession``, one chat turn at a time through
the chat-turn core (``chat_turn.py``, the proxy's too) over ``SessionCore``."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from leyline_agent.accounting import TurnRecord
from leyline_agent.chat.render import Renderer
from leyline_agent.chat_turn import complete, prepare
from leyline_agent.client import LeylineClient
from leyline_agent.markers import DEFAULT_TTL_S
from leyline_agent.placement import DEFAULT_SHARED_NAMESPACE
from leyline_agent.retention import fork
from leyline_agent.session import SessionCore
from leyline_agent.wire import PinResponse
from leyline_agent.wrapper import ConversationWrapper

log = logging.getLogger(__name__)


class LeylineSession:
    """In-process API for Python agent loops.

    ``LeylineSession(base_url="http://127.0.0.1:30000", policy="stale_tool_outputs:keep_last=2")``
    then ``session.chat(messages, tools=tools, max_tokens=64)`` returns the backend's OpenAI-style
    chat completion (a dict) with ``usage.prompt_tokens_details.cached_tokens`` filled in.

    Args:
        base_url: a Leyline-enabled SGLang server (``leyline serve``), without ``/v1``.
        policy: a policy or spec string.
        model_path: model directory whose chat template the server uses (None: embedded default),
            or a loaded ``Renderer``.
        splice: False sends the edited request without directives (re-prefill).
        api_key: the server's key (``leyline serve --api-key``).
        share_exact: requests use ``shared_namespace`` (exact KV, shared with every session
            using it) until the first splice, then the session's own namespace; False: its own
            from the first request.
        shared_namespace: default ``leyline:default:shared``, the proxy's tenant ``default``.

    Messages and tools may carry Anthropic-style ``cache_control`` markers (at most 4): after the
    turn the prompt up to each marked message (or the tools) is pinned for that marker's own TTL
    (``SessionPins.pin_marked``: one pin per breakpoint, renewed when marked again, released when
    no longer marked and of no use); a refused pin never fails the turn (``pin_error``: the last
    refusal). ``fork()`` starts a sub-agent from this session; ``close()`` releases the
    session's pins.
    """

    def __init__(
        self,
        base_url: str,
        policy: Any = "none",
        *,
        model: str | None = None,
        model_path: str | Renderer | None = None,
        session_id: str | None = None,
        splice: bool = True,
        timeout: float = 600.0,
        api_key: str | None = None,
        share_exact: bool = True,
        shared_namespace: str = DEFAULT_SHARED_NAMESPACE,
        client: LeylineClient | None = None,
    ) -> None:
        self._owns_client = client is None
        self.client = client or LeylineClient(base_url, timeout=timeout, api_key=api_key)
        self.model = model or "default"
        self.core = SessionCore(
            self.client,
            ConversationWrapper(model_path, policy),
            session_id=session_id,
            splice=splice,
            share_exact=share_exact,
            shared_namespace=shared_namespace,
        )
        self.pin_error: str | None = None  # the last marked turn's refused pin

    def fork(self, session_id: str | None = None, policy: Any = None) -> LeylineSession:
        """A new session (sub-agent) starting from this one's history, on the same backend
        (``retention.fork``: a private session's KV is copied into the child's namespace).
        ``policy``: the child's (default: this session's). Raises ``ForkRejected`` (e.g. 409:
        this session's KV was evicted)."""
        core, where = self.core, self.core.placement
        child = LeylineSession(
            self.client.base_url,
            core.wrapper.policy if policy is None else policy,
            model=self.model,
            model_path=core.wrapper.renderer,
            session_id=session_id,
            splice=core.splice_enabled,
            share_exact=where.share_exact,
            shared_namespace=where.shared,
            client=self.client,
        )
        fork(child.core, core)
        return child

    def pin(self, end: int | None = None, ttl_s: float = DEFAULT_TTL_S) -> PinResponse:
        """Keep the first ``end`` held tokens (None: all) resident for ``ttl_s`` seconds
        (``SessionPins.pin``: the session's pin of that prefix, renewed; its pins of other
        prefixes stay). Raises ``PinRejected``, or
        ``ValueError`` when nothing is held."""
        return self.core.pins.pin(self.core.wrapper.tokens[:end], ttl_s=ttl_s)

    def close(self) -> None:
        """Release the session's pins; close the HTTP client when this session made it."""
        try:
            if self.core.pins.pins:
                self.core.pins.release()
        finally:
            if self._owns_client:
                self.client.close()

    def __enter__(self) -> LeylineSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def records(self) -> list[TurnRecord]:
        return self.core.records

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None = None,
        **sampling: Any,
    ) -> dict[str, Any]:
        """Send one turn (``chat_turn.prepare`` → POST → ``chat_turn.complete``); ``sampling``:
        the other fields of an OpenAI chat-completions body (``max_tokens``, ``cache_salt``,
        ``tool_choice``, ``continue_final_message``, ...).

        Raises:
            RequestRefused: the backend would refuse the request (malformed messages, a prompt
                past the context length): found before any splice, nothing changed.
            PolicyError, DirectiveError, jinja2.TemplateError: as ``chat_turn.prepare``.
            httpx.HTTPStatusError: the backend answered an error (a turn whose splice ran is
                still recorded, with its ``error``).
        """
        body: dict[str, Any] = {"model": self.model, **sampling, "messages": list(messages)}
        if tools:
            body["tools"] = list(tools)
        turn = prepare(self.core, body, context_len=self.client.context_len())
        t0 = time.perf_counter()
        r = self.client.http.post("/v1/chat/completions", json=turn.body)
        request_ms = (time.perf_counter() - t0) * 1e3
        if r.status_code != 200 and turn.pending.committed:
            complete(self.core, turn, None, request_ms=request_ms,
                     error=f"backend status {r.status_code}")  # fmt: skip
        r.raise_for_status()
        data = r.json()
        complete(self.core, turn, data, request_ms=request_ms, prompt_ids=turn.prompt_ids(data))
        for marker in turn.markers:
            if marker.ttl_note is not None:  # NOTE: clamped to 24 h, or invalid: the default
                log.warning(
                    "session %s: cache_control ttl %r %s: pinned for %g s",
                    self.core.session_id, marker.ttl, marker.ttl_note, marker.ttl_s,
                )  # fmt: skip
        if turn.markers:
            outcome = self.core.pins.pin_marked(
                self.core.wrapper.tokens, turn.pending.plan, turn.markers,
                self.core.wrapper.renderer.decode,
            )  # fmt: skip
            self.pin_error = str(outcome.refused[-1]) if outcome.refused else None
        return data
