"""One conversation against a Leyline backend: policy → diff → splice → request → bookkeeping.

This is the single code path shared by the in-process API (:class:`LeylineSession`), the proxy
and ``leyline replay``. Pure Python (httpx); no torch, no sglang.

Per turn::

    pending = core.begin(messages, tools)   # policy + diff; POST /leyline/splice when enabled
    ...send pending.plan.messages (chat) or pending.plan.tokens (/generate), namespaced...
    record = core.finish(pending, prompt_tokens=..., cached_tokens=..., request_ms=...)

If a splice cannot run (backend restarted, entry evicted, backend without the plugin) the request
is still sent: the answer stays correct and the turn counts as a miss (``record.splice_error``).

The session's tokens follow the backend's cache, not the request's fate:

- a splice that succeeded is committed at once (the spliced prefix), so a request that then
  fails, times out or is cut off leaves the session on what the backend really holds;
- ``finish(prompt_ids=...)``: the backend's own prompt token ids (SGLang's
  ``return_prompt_token_ids``); when they differ from the rendered ones (a template or tokenizer
  the renderer does not mirror) the session adopts them (``record.render_mismatch``,
  ``record.resynced``) so the next splice refers to what is really cached.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel

from leyline_agent.chat.request import final_assistant, length_error, template_kwargs
from leyline_agent.chat.sglang import sglang_tools
from leyline_agent.client import GenerateResult, LeylineClient, SpliceRejected, SpliceResult
from leyline_agent.directive import Mode
from leyline_agent.wrapper import ConversationWrapper, TurnPlan


class TurnRecord(BaseModel):
    """Counters of one turn (tokens are counts; times in milliseconds)."""

    turn: int
    prompt_tokens: int
    cached_tokens: int
    prefilled_tokens: int
    splice_prefilled: int = 0
    rotated_tokens: int = 0
    best_cached_tokens: int
    directives_amortize: int = 0
    directives_forget: int = 0
    edited: bool = False
    spliced: bool = False
    splice_error: str | None = None
    splice_miss_reason: str | None = None  # client.miss_reason of splice_error
    splice_ms: float = 0.0
    request_ms: float = 0.0
    ttft_ms: float | None = None
    first_token: int | None = None
    render_mismatch: bool = False  # the backend's prompt tokens differ from the rendered ones
    resynced: bool = False  # ... and the session adopted the backend's tokens
    error: str | None = None  # the request failed after the cache changed (a splice ran)


class RequestRefused(ValueError):
    """The backend would certainly refuse this request (found before any splice)."""


@dataclass
class Pending:
    plan: TurnPlan
    splice: SpliceResult | None
    splice_error: str | None
    splice_ms: float
    t_start: float
    splice_miss_reason: str | None = None
    best_cached: int = 0
    committed: bool = False  # the splice ran: the wrapper already holds the spliced prefix
    final: dict[str, Any] | None = None  # the assistant message continued (continue_final)


class SessionCore:
    """Policy, diff and splice for one session; owns its backend namespace (``extra_key``).

    Args:
        client: the backend.
        wrapper: the session's ConversationWrapper (holds the policy and the renderer).
        session_id: stable id; the namespace is ``leyline:<session_id>`` unless given.
        splice: send directives to ``/leyline/splice`` (False: the re-prefill arm).
        cache_salt: SGLang's ``cache_salt``. The backend keys its cache by ``(extra_key,
            cache_salt)``: one value, sent with every request and every splice of the session.
    """

    def __init__(
        self,
        client: LeylineClient,
        wrapper: ConversationWrapper,
        *,
        session_id: str | None = None,
        splice: bool = True,
        namespace: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.client = client
        self.cache_salt = cache_salt or None
        self.wrapper = wrapper
        self.session_id = session_id or uuid.uuid4().hex
        self.namespace = namespace or f"leyline:{self.session_id}"
        self.splice_enabled = splice
        self.records: list[TurnRecord] = []
        self.messages: list[dict[str, Any]] = []

    def set_cache_salt(self, cache_salt: str | None) -> None:
        """Use the client's ``cache_salt`` from this turn on. A changed salt is another cache
        namespace: nothing cached so far is reachable in it, so the session forgets its tokens
        (the turn is prefilled in full, no splice refers to the old namespace)."""
        cache_salt = cache_salt or None
        if cache_salt != self.cache_salt:
            self.cache_salt = cache_salt
            self.wrapper.reset()

    def begin(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None = None,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
        continue_final: bool = False,
        context_len: int | None = None,
        max_new_tokens: int | None = None,
    ) -> Pending:
        """Policy, diff and (when there are directives) the splice.

        Args:
            template_kwargs: extra chat-template variables (see ``chat.request.template_kwargs``).
            continue_final: SGLang's ``continue_final_message``: a final assistant message is
                not rendered; its text is appended after the generation prompt.
            context_len, max_new_tokens: refuse a prompt that does not fit, before the splice.

        Raises:
            RequestRefused: the prompt does not fit the context (SGLang's message).
            PolicyError, DirectiveError, jinja2.TemplateError: as ``ConversationWrapper.plan``.
        """
        t0 = time.perf_counter()
        final: dict[str, Any] | None = None
        prefix: str | None = None
        if continue_final:
            rest, prefix = final_assistant(messages, True)
            if prefix is not None:
                final, messages = dict(messages[-1]), rest
        plan = self.wrapper.plan(messages, tools, template_kwargs=template_kwargs)
        if prefix:  # SGLang appends encode(prefix) to the prompt ids
            extra = self.wrapper.renderer.encode(prefix)
            plan = replace(plan, tokens=[*plan.tokens, *extra], tail=[*plan.tail, *extra])
        refused = length_error(len(plan.tokens), max_new_tokens, context_len)
        if refused is not None:
            raise RequestRefused(refused)
        best = self.best_cached(plan)
        result: SpliceResult | None = None
        error: str | None = None
        reason: str | None = None
        splice_ms = 0.0
        if self.splice_enabled and plan.directives and self.wrapper.tokens:
            try:
                result = self.client.splice(
                    self.wrapper.tokens,
                    plan.directives,
                    extra_key=self.namespace,
                    cache_salt=self.cache_salt,
                )
                splice_ms = result.http_ms
            except SpliceRejected as e:
                error, reason = f"{e.status}: {e.message}", e.reason
                splice_ms = (time.perf_counter() - t0) * 1e3
        pending = Pending(plan, result, error, splice_ms, t0, reason, best, final=final)
        if result is not None:  # NOTE: the backend now holds the spliced prefix, whatever follows
            self.wrapper.commit(plan, plan.tokens[: len(plan.tokens) - len(plan.tail)])
            pending.committed = True
        return pending

    def chat_body(self, pending: Pending, body: Mapping[str, Any]) -> dict[str, Any]:
        """The chat-completions body to send: ``body`` with the planned (edited) messages and
        tools, in this session's namespace."""
        messages = pending.plan.messages + ([pending.final] if pending.final else [])
        out = {**body, "messages": messages, "extra_key": self.namespace}
        out.pop("cache_salt", None)
        if self.cache_salt:
            out["cache_salt"] = self.cache_salt
        if pending.plan.tools:
            out["tools"] = pending.plan.tools
        return out

    def best_cached(self, plan: TurnPlan) -> int:
        """Theoretical best cached tokens for this turn under this session's arm.

        splice: everything but the new tail and the replacements; re-prefill: the prefix before
        the first edit; first turn: 0.
        """
        if not self.wrapper.tokens:
            return 0
        if not plan.directives:
            return plan.base_len
        if self.splice_enabled:
            return (
                len(plan.tokens) - len(plan.tail) - sum(len(d.replacement) for d in plan.directives)
            )
        return min(d.start for d in plan.directives)

    def finish(
        self,
        pending: Pending,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        request_ms: float,
        ttft_ms: float | None = None,
        first_token: int | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        prompt_ids: Sequence[int] | None = None,
        error: str | None = None,
        prefilled: bool = True,
    ) -> TurnRecord:
        """Record the turn and set the session's tokens to what the backend holds.

        Args:
            prompt_ids: the backend's prompt token ids, when it returned them: adopted when they
                differ from the plan's (a resync).
            error: the request failed after reaching the backend (recorded with the turn).
            prefilled: the backend prefilled the whole prompt (False: it holds the spliced
                prefix at most, e.g. a request refused or cut off before its first token).
        """
        plan = pending.plan
        held: list[int] | None = list(plan.tokens) if prefilled else None
        mismatch = resynced = False
        if prompt_ids is not None:
            mismatch = list(prompt_ids) != plan.tokens
            if mismatch:
                held, resynced = list(prompt_ids), True
        elif prefilled and error is None and prompt_tokens != len(plan.tokens):
            mismatch, held = True, []  # unknown tokens: the next turn splices nothing
        modes = [d.mode for d in plan.directives]
        splice_prefilled = pending.splice.prefilled if pending.splice else 0
        record = TurnRecord(
            turn=len(self.records),
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            prefilled_tokens=prompt_tokens - cached_tokens + splice_prefilled,
            splice_prefilled=splice_prefilled,
            rotated_tokens=pending.splice.rotated if pending.splice else 0,
            best_cached_tokens=min(pending.best_cached, prompt_tokens),
            directives_amortize=modes.count(Mode.AMORTIZE),
            directives_forget=modes.count(Mode.FORGET),
            edited=bool(plan.directives),
            spliced=pending.splice is not None,
            splice_error=pending.splice_error,
            splice_miss_reason=pending.splice_miss_reason,
            splice_ms=pending.splice_ms,
            request_ms=request_ms,
            ttft_ms=ttft_ms,
            first_token=first_token,
            render_mismatch=mismatch,
            resynced=resynced,
            error=error,
        )
        if pending.committed:
            if held is not None:
                self.wrapper.hold(held)
        elif held is not None:
            self.wrapper.commit(plan, held)
        if messages is not None:
            self.messages = [dict(m) for m in messages]
        self.records.append(record)
        return record

    def generate(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None = None,
        *,
        max_new_tokens: int = 1,
    ) -> tuple[TurnRecord, GenerateResult]:
        """One teacher-forced turn through ``/generate`` with the rendered token ids."""
        pending = self.begin(messages, tools)
        out = self.client.generate(
            pending.plan.tokens,
            extra_key=self.namespace,
            cache_salt=self.cache_salt,
            max_new_tokens=max_new_tokens,
        )
        record = self.finish(
            pending,
            prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens,
            request_ms=out.e2e_ms,
            ttft_ms=out.meta.get("ttft_ms") or out.e2e_ms,
            first_token=out.output_ids[0] if out.output_ids else None,
            messages=messages,
        )
        return record, out


def _served_message(message: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(message)
    if out.get("content") is None:
        out["content"] = ""
    if isinstance(out.get("tool_calls"), list):
        calls = []
        for call in out["tool_calls"]:
            fn = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
                try:
                    args = json.loads(fn["arguments"])
                except ValueError:
                    args = None  # the server rejects it; keep the agent's text
                if isinstance(args, dict):
                    fn = {**fn, "arguments": json.dumps(args, ensure_ascii=False)}
                    call = {**call, "function": fn}
            calls.append(call)
        out["tool_calls"] = calls
    return out


def chat_request_view(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: Any = None,
    continue_final_message: bool = False,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools of a chat request as SGLang's chat template will see them.

    SGLang (0.5.x) passes every tool through its pydantic ``Tool`` model before templating (which
    adds ``"defer_loading": null``, ``description``/``parameters`` when absent, and drops unknown
    keys), parses tool-call ``arguments`` strings into objects that the template re-serialises
    with ``tojson``, renders no tools under ``tool_choice="none"`` and only the named one under a
    named ``tool_choice``, and renders a final assistant message with text content as a user
    turn (unless ``continue_final_message``: ``SessionCore.begin(continue_final=True)``).
    Planning on the raw request would give other tokens than the server's prompt (every splice
    would then miss). This view is a fixed point of that normalisation: send it and render it,
    and both sides agree. Semantics are unchanged.
    """
    if tools and tool_choice == "none":
        tools = None
    elif tools and isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name")
        tools = [t for t in tools if (t.get("function") or {}).get("name") == name] or None
    served = [_served_message(m) for m in messages]
    if not continue_final_message:
        served = final_assistant(served)[0]
    return served, sglang_tools(tools)


def pop_prompt_ids(data: dict[str, Any], keep: bool = False) -> list[int] | None:
    """The prompt token ids of a non-streamed chat completion asked with
    ``return_prompt_token_ids`` (SGLang 0.5.23 puts them in every choice, as
    ``choices[i].prompt_token_ids``), removed from ``data`` unless ``keep``."""
    ids: list[int] | None = None
    for choice in data.get("choices") or []:
        if isinstance(choice, dict) and isinstance(choice.get("prompt_token_ids"), list):
            ids = ids if ids is not None else list(choice["prompt_token_ids"])
            if not keep:
                del choice["prompt_token_ids"]
    return ids


def read_usage(data: dict[str, Any], default_prompt: int) -> tuple[int, int]:
    """``(prompt_tokens, cached_tokens)`` of a chat completion (or its streamed usage chunk).

    Fills ``usage.prompt_tokens_details.cached_tokens`` in place (0 when the backend did not
    report it, e.g. SGLang without ``--enable-cache-report``); ``default_prompt`` stands in for a
    missing ``usage.prompt_tokens``.
    """
    usage = data.get("usage") or {}
    prompt = int(usage.get("prompt_tokens", default_prompt))
    details = usage.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or 0)
    usage["prompt_tokens_details"] = {**details, "cached_tokens": cached}
    data["usage"] = usage
    return prompt, cached


class LeylineSession:
    """In-process API for Python agent loops.

    ``LeylineSession(base_url="http://127.0.0.1:30000", policy="stale_tool_outputs:keep_last=2")``
    then ``session.chat(messages, tools=tools, max_tokens=64)`` returns the backend's OpenAI-style
    chat completion (a dict) with ``usage.prompt_tokens_details.cached_tokens`` filled in.

    Args:
        base_url: a Leyline-enabled SGLang server (``leyline serve``), without ``/v1``.
        policy: a policy or spec string.
        model_path: model directory whose chat template the server uses (None: embedded default).
        splice: False sends the edited request without directives (re-prefill).
        api_key: the server's key (``leyline serve --api-key``).
    """

    def __init__(
        self,
        base_url: str,
        policy: Any = "none",
        *,
        model: str | None = None,
        model_path: str | None = None,
        session_id: str | None = None,
        splice: bool = True,
        timeout: float = 600.0,
        api_key: str | None = None,
    ) -> None:
        self.client = LeylineClient(base_url, timeout=timeout, api_key=api_key)
        self.model = model or "default"
        self.core = SessionCore(
            self.client,
            ConversationWrapper(model_path, policy),
            session_id=session_id,
            splice=splice,
        )

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
        )
        return data
