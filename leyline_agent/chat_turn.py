"""The OpenAI chat turn, one core under every front door (``api.LeylineSession.chat``, the
proxy's ``POST /v1/chat/completions``): request view → turn core → response view.

Per turn::

    turn = prepare(core, body, context_len=n)   # checks, salt, view, plan, length, splice
    ...POST turn.body to the backend's /v1/chat/completions (streamed or not)...
    record = complete(core, turn, data, request_ms=ms, prompt_ids=turn.prompt_ids(data))

``prepare`` refuses what the backend would certainly refuse (``RequestRefused``: malformed
messages, a prompt past the context length) *before* any splice, so a refused request never
changes the cache. A new API surface is a thin adapter: it builds a chat body from its own request
(its request view), calls these two halves, and writes its own response view of the answer.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from leyline_agent import gateway, inband
from leyline_agent.accounting import TurnRecord
from leyline_agent.chat.openai import (
    chat_request_view,
    pop_prompt_ids,
    read_usage,
    renders_developer,
    served_message,
)
from leyline_agent.chat.request import (
    final_assistant,
    length_error,
    max_new_tokens,
    request_error,
    template_kwargs,
)
from leyline_agent.markers import Marker, Marks, breakpoint_error, cache_markers, message_marks
from leyline_agent.policies.protocol import Policy
from leyline_agent.session import Pending, SessionCore


class RequestRefused(ValueError):
    """The backend would certainly refuse this request (found before any splice)."""


@dataclass
class ChatTurn:
    """A prepared chat turn: the session's pending turn, the body to send, and what the client
    sent (its messages, tools and ``cache_control`` breakpoints: ``markers``, in prompt order;
    ``marker``, the last of them)."""

    pending: Pending
    body: dict[str, Any]
    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Any] | None
    marker: Marker | None
    keep_ids: bool = False  # the client asked for the prompt token ids itself
    markers: Sequence[Marker] = ()
    edit: dict[str, Any] | None = None  # behind a gateway: the in-band splice in ``body``

    def prompt_ids(self, data: dict[str, Any]) -> list[int] | None:
        """The backend's prompt token ids of a non-streamed answer, removed from ``data``
        unless the client asked for them."""
        return pop_prompt_ids(data, keep=self.keep_ids)


def request_refusal(body: Any, known: int = 0, marks: Marks = None) -> str | None:
    """Why the backend would refuse this chat body with a 400 before templating (None: it may
    not): ``chat.request.request_error``, a ``cache_salt`` that is not a string, and more
    ``cache_control`` breakpoints than Anthropic allows (``markers.breakpoint_error``).
    ``known``, ``marks``: the first messages are known to pass, and every message's markers
    (``SessionCore.seen``)."""
    refused = request_error(body, known)
    if refused is None:
        refused = breakpoint_error(body["messages"], body.get("tools"), marks)
    if refused is None and not isinstance(body.get("cache_salt") or "", str):
        refused = "'cache_salt' must be a string"
    if refused is None and not isinstance(body.get("lora_path") or "", str):
        refused = "'lora_path' must be a string (one adapter per chat request)"
    return refused


def _check_every() -> int:
    value = os.environ.get("LEYLINE_RENDER_CHECK_EVERY", "16")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"LEYLINE_RENDER_CHECK_EVERY must be an integer >= 1, not {value!r}")
    return int(value)


# Turns between two render-parity checks of a session that passed them (1: every turn, as the
# tests run; ``LEYLINE_RENDER_CHECK_EVERY``).
CHECK_EVERY = _check_every()


def render_check(core: SessionCore, pending: Pending, kwargs: Mapping[str, Any] | None) -> bool:
    """Whether this turn asks the backend for its prompt token ids, to compare them with the
    rendered ones (``SessionCore.finish``: ``render_mismatch``, adopted as a resync).

    Asked where the rendering may disagree with the backend's: the session's first turn and
    every ``CHECK_EVERY``-th, a turn with template variables (``kwargs``) or a fallback plan (the
    template rendered unchanged messages differently), a turn after one whose ids or length
    disagreed or whose tokens are unknown (``wrapper.tokens`` empty). Other turns check the
    answer's prompt length only: the ids cost the backend and the proxy a JSON list of the whole
    prompt (about 3 ms at 30k tokens) on every turn.
    """
    records = core.records
    if not records or len(records) % CHECK_EVERY == 0 or not core.wrapper.tokens:
        return True
    last = records[-1]
    return bool(kwargs) or pending.plan.fallback or last.render_mismatch or last.resynced


def prepare(
    core: SessionCore,
    body: Mapping[str, Any],
    *,
    context_len: int | None = None,
    policy: Policy | None = None,
    fit_budget: bool = False,
) -> ChatTurn:
    """Check, plan and splice one chat-completions ``body`` (OpenAI's, with SGLang's extras).

    Args:
        core: the session.
        body: the client's request; ``stream`` asks for a streamed answer (the body to send then
            asks for usage, and the prompt ids where ``render_check`` does, in the stream; see
            ``proxy/relay.py``).
        context_len: the backend's context length (None: unknown, not checked).
        policy: this turn's own edits after the session's policy (e.g. the context editing an
            Anthropic request asks for).
        fit_budget: the completion budget (``max_tokens``) is a cap: lowered to what the
            context leaves after the prompt instead of refused (the Messages API's clients ask
            for the model's whole output limit, Claude Code 128,000 tokens).

    Raises:
        RequestRefused: the backend would refuse the request (its message), found before any
            splice; nothing changed.
        PolicyError, DirectiveError: the policy's edits cannot be applied.
        jinja2.TemplateError: the chat template refused the messages.
    """
    # NOTE: the messages the session's last request held (resent every turn) are checked,
    # served and read for markers once (``SessionCore.seen``)
    seen, listed = core.seen, body.get("messages") if isinstance(body, Mapping) else None
    known = seen.known(listed)
    marks = None
    if isinstance(listed, list):  # read once: for the refusal check and the breakpoints
        marks = [*seen.marks[:known], *map(message_marks, listed[known:])]
    refused = request_refusal(body, known, marks)
    if refused is not None:
        raise RequestRefused(refused)
    messages: Sequence[Mapping[str, Any]] = body["messages"]
    assert marks is not None  # request_refusal: 'messages' is a list
    served = [*seen.served[:known], *map(served_message, messages[known:])]
    seen.update(messages, known, served, marks)
    tools = body.get("tools") or None
    core.set_cache_salt(body.get("cache_salt"))
    core.set_adapter(inband.lora_adapter(body))
    cont = bool(body.get("continue_final_message"))
    developer = not renders_developer(core.wrapper.renderer)  # sent as system where not served
    view, view_tools = chat_request_view(
        messages, tools, body.get("tool_choice"), cont, developer_as_system=developer,
        served=served,
    )  # fmt: skip
    final: dict[str, Any] | None = None
    continued: str | None = None
    if cont:
        rest, continued = final_assistant(view, True)
        if continued is not None:
            final, view = view[-1], rest
    pending = core.plan(
        view, view_tools, template_kwargs=template_kwargs(body), final=final,
        continued=continued, policy=policy,
    )  # fmt: skip
    prompt, budget = len(pending.plan.tokens), max_new_tokens(body)
    if fit_budget and context_len and budget is not None and prompt < context_len:
        budget = min(budget, context_len - prompt)  # NOTE: a cap, not a demand (Messages API)
    refused = length_error(prompt, budget, context_len)
    if refused is not None:
        raise RequestRefused(refused)
    edit = None
    if core.placement.client.gateway:
        edit = gateway.defer(core, pending)
    else:
        core.splice(pending)
    forward = core.chat_body(pending, body)
    if edit is not None:  # NOTE: the splice rides on the request (gateway.py)
        forward = {**gateway.namespace(core, edit).apply(forward), inband.FIELD: edit}
    if budget is not None and budget != max_new_tokens(body):
        forward.pop("max_completion_tokens", None)
        forward["max_tokens"] = budget
    keep = bool(body.get("return_prompt_token_ids") or body.get("return_token_ids"))
    check = keep or render_check(core, pending, template_kwargs(body))
    if body.get("stream"):
        options = body.get("stream_options") or {}
        forward["stream_options"] = {**options, "include_usage": True}
        if check:
            forward["return_input_ids_in_sglext"] = True
    elif check:
        forward["return_prompt_token_ids"] = True
    markers = cache_markers(messages, tools, marks)
    last = markers[-1] if markers else None
    return ChatTurn(pending, forward, messages, tools, last, keep, markers, edit)


def complete(
    core: SessionCore,
    turn: ChatTurn,
    data: dict[str, Any] | None,
    *,
    request_ms: float,
    ttft_ms: float | None = None,
    prompt_ids: list[int] | None = None,
    error: str | None = None,
) -> TurnRecord:
    """Record the turn (``SessionCore.finish``) from the backend's answer.

    Args:
        data: the answer, or its streamed usage chunk (``usage.prompt_tokens_details`` is filled
            in place); None: the request failed or was cut off after reaching the backend
            (``error``), recorded with what is known: prefilled only if a first token came
            (``ttft_ms``).
        prompt_ids: the backend's prompt token ids (``ChatTurn.prompt_ids``, or the stream's).
    """
    tokens = len(turn.pending.plan.tokens)
    completion: int | None = None
    if data is not None:
        prompt, cached = read_usage(data, tokens)
        completion = data["usage"].get("completion_tokens")
        cached = _parallel_cached(turn, data, cached)
    else:
        prompt, cached = (tokens if ttft_ms is not None else 0), 0
    return core.finish(
        turn.pending,
        prompt_tokens=prompt,
        cached_tokens=cached,
        request_ms=request_ms,
        ttft_ms=ttft_ms,
        messages=turn.messages,
        prompt_ids=prompt_ids,
        error=error,
        prefilled=data is not None or ttft_ms is not None,
        completion_tokens=completion,
    )


def _parallel_cached(turn: ChatTurn, data: dict[str, Any], cached: int) -> int:
    """The cache hit of an ``n`` > 1 answer, bounded by what the session may reuse.

    SGLang (0.5.23, ``TokenizerManager``) prefills the prompt of a parallel-sampling request
    once, in a prefill-only warm-up whose answer it drops, then samples ``n`` times; its usage
    counts the prompt once but reports the samples' cache hit, which the warm-up just filled (a
    cold prompt reads as cached but one token). Clamped to the turn's bound (``best_reused``,
    plus what its splice prefilled) in the answer and the record: exact in the session's own
    namespace; in the shared one (before its first splice) the bound is the whole prompt, as
    other sessions fill it too.
    """
    n = turn.body.get("n")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 1:
        return cached
    splice = turn.pending.splice
    bound = splice.best_reused + (splice.response.prefilled if splice.response else 0)
    if cached > bound:
        cached = bound
        data["usage"]["prompt_tokens_details"]["cached_tokens"] = cached
    return cached
