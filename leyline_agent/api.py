"""The in-process API for Python agent loops: ``LeylineSession``, one chat turn at a time through
``SessionCore`` (the code path the proxy and ``leyline replay`` share)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from leyline_agent.accounting import TurnRecord
from leyline_agent.backends.sglang.wire import PinResponse
from leyline_agent.chat.openai import chat_request_view, pop_prompt_ids, read_usage
from leyline_agent.chat.render import Renderer
from leyline_agent.chat.request import template_kwargs
from leyline_agent.client import LeylineClient, PinRejected
from leyline_agent.pins import DEFAULT_TTL_S, cache_marker
from leyline_agent.session import DEFAULT_SHARED_NAMESPACE, SessionCore
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

    Messages may carry Anthropic-style ``cache_control`` markers: after the turn the prompt up to
    the last marked message is pinned (``pin``); a refused pin never fails the turn
    (``pin_error``). ``fork()`` starts a sub-agent from this session; ``close()`` releases the
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
        (``SessionCore.adopt``: a private session's KV is copied into the child's namespace).
        ``policy``: the child's (default: this session's). Raises ``ForkRejected`` (e.g. 409:
        this session's KV was evicted)."""
        core = self.core
        child = LeylineSession(
            self.client.base_url,
            core.wrapper.policy if policy is None else policy,
            model=self.model,
            model_path=core.wrapper.renderer,
            session_id=session_id,
            splice=core.splice_enabled,
            share_exact=core.share_exact,
            shared_namespace=core.shared_namespace,
            client=self.client,
        )
        child.core.adopt(core)
        return child

    def pin(self, end: int | None = None, ttl_s: float = DEFAULT_TTL_S) -> PinResponse:
        """Keep the first ``end`` held tokens (None: all) resident for ``ttl_s`` seconds
        (``SessionCore.pin``; one pin per session, renewed). Raises ``PinRejected``."""
        return self.core.pin(end, ttl_s=ttl_s)

    def close(self) -> None:
        """Release the session's pins; close the HTTP client when this session made it."""
        try:
            if self.core.pinned is not None:
                self.core.release_pins()
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
        """Send one turn. Raises ``httpx.HTTPStatusError`` when the backend answers an error
        (a turn whose splice ran is still recorded, with its ``error``)."""
        cont = bool(sampling.get("continue_final_message"))
        self.core.set_cache_salt(sampling.get("cache_salt"))
        view = chat_request_view(messages, tools, sampling.get("tool_choice"), cont)
        pending = self.core.begin(
            *view, template_kwargs=template_kwargs(sampling), continue_final=cont
        )
        body: dict[str, Any] = {"model": sampling.pop("model", self.model), **sampling}
        body["return_prompt_token_ids"] = True
        t0 = time.perf_counter()
        r = self.client.http.post("/v1/chat/completions", json=self.core.chat_body(pending, body))
        request_ms = (time.perf_counter() - t0) * 1e3
        if r.status_code != 200 and pending.committed:
            self.core.finish(
                pending,
                prompt_tokens=0,
                cached_tokens=0,
                request_ms=request_ms,
                messages=messages,
                error=f"backend {r.status_code}",
                prefilled=False,
            )
        r.raise_for_status()
        data = r.json()
        ids = pop_prompt_ids(data, keep=bool(sampling.get("return_prompt_token_ids")))
        prompt, cached = read_usage(data, len(pending.plan.tokens))
        self.core.finish(
            pending,
            prompt_tokens=prompt,
            cached_tokens=cached,
            request_ms=request_ms,
            messages=messages,
            prompt_ids=ids,
            completion_tokens=data["usage"].get("completion_tokens"),
        )
        marker = cache_marker(messages)  # NOTE: the view has no markers; same indices
        if marker is not None:
            if marker.ttl_note is not None:  # NOTE: clamped to 24 h, or invalid: the default
                log.warning(
                    "session %s: cache_control ttl %r %s: pinned for %g s",
                    self.core.session_id, marker.ttl, marker.ttl_note, marker.ttl_s,
                )  # fmt: skip
            try:
                self.pin_error = None
                self.core.pin_marked(pending, marker)
            except PinRejected as e:
                self.pin_error = str(e)
        return data
