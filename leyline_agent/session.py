"""One conversation against a Leyline backend: policy → diff → splice → request → bookkeeping.

This is the single code path shared by the in-process API (``api.LeylineSession``), the proxy
and ``leyline replay``. Pure Python (httpx); no torch, no sglang.

Per turn::

    pending = core.begin(messages, tools)   # policy + diff; POST /leyline/splice when enabled
    ...send pending.plan.messages (chat) or pending.plan.tokens (/generate), namespaced...
    record = core.finish(pending, prompt_tokens=..., cached_tokens=..., request_ms=...)

If a splice cannot run (backend restarted, entry evicted, backend without the plugin) the request
is still sent: the answer stays correct and the turn counts as a miss (``record.splice_error``).

Namespaces (``share_exact``, the default): exact KV (never spliced) is shared, amortized KV is
private. A session's requests go to the tenant's shared namespace (``shared_namespace``) until its
first splice; that splice is sent with ``extra_key`` = shared and ``target_extra_key`` = the
session's own (``namespace``), so the server copies the unchanged prefix into it and builds the
edited sequence there only; every later request and splice uses the session's own namespace
(``private``). A session that never splices stays shared, so sessions with the same system prompt
prefill it once. ``share_exact=False``: every request in the session's own namespace (before this
change). ``namespace`` is always the session's own: routing (``routing.py``), pin owner, forks.

The session's tokens follow the backend's cache, not the request's fate:

- a splice that succeeded is committed at once (the spliced prefix), so a request that then
  fails, times out or is cut off leaves the session on what the backend really holds;
- ``finish(prompt_ids=...)``: the backend's own prompt token ids (SGLang's
  ``return_prompt_token_ids``); when they differ from the rendered ones (a template or tokenizer
  the renderer does not mirror) the session adopts them (``record.render_mismatch``,
  ``record.resynced``) so the next splice refers to what is really cached.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from leyline_agent.accounting import TurnRecord, best_reused
from leyline_agent.backends.sglang.wire import ForkResponse, Namespace, PinResponse, SpliceResponse
from leyline_agent.chat.request import final_assistant, length_error
from leyline_agent.client import GenerateResult, LeylineClient, PinRejected, SpliceRejected
from leyline_agent.pins import DEFAULT_TTL_S, Marker, marked_end
from leyline_agent.wrapper import ConversationWrapper, TurnPlan

# NOTE: the proxy's shared namespace of tenant ``default`` (``SessionKey.shared_namespace``): the
# in-process API and the proxy's default tenant share exact KV.
DEFAULT_SHARED_NAMESPACE = "leyline:default:shared"


class RequestRefused(ValueError):
    """The backend would certainly refuse this request (found before any splice)."""


@dataclass
class Pending:
    plan: TurnPlan
    splice: SpliceResponse | None
    splice_error: str | None
    splice_ms: float
    t_start: float
    splice_miss_reason: str | None = None
    best_reused: int = 0
    committed: bool = False  # the splice ran: the wrapper already holds the spliced prefix
    final: dict[str, Any] | None = None  # the assistant message continued (continue_final)


class SessionCore:
    """Policy, diff and splice for one session; owns its backend namespace (``extra_key``).

    Args:
        client: the backend.
        wrapper: the session's ConversationWrapper (holds the policy and the renderer).
        session_id: stable id; the namespace is ``leyline:<session_id>`` unless given.
        splice: send directives to ``/leyline/splice`` (False: the re-prefill arm).
        namespace: the session's own (private) ``extra_key``.
        cache_salt: SGLang's ``cache_salt``. The backend keys its cache by ``(extra_key,
            cache_salt)``: one salt for every request and every splice of the session.
        share_exact: requests use ``shared_namespace`` until the first splice (module docstring).
        shared_namespace: the tenant's namespace of exact KV; must differ from ``namespace``.

    Raises:
        ValueError: ``shared_namespace`` equals the session's own namespace.
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
        share_exact: bool = True,
        shared_namespace: str = DEFAULT_SHARED_NAMESPACE,
    ) -> None:
        self.client = client
        self.cache_salt = cache_salt or None
        self.wrapper = wrapper
        self.session_id = session_id or uuid.uuid4().hex
        self.namespace = namespace or f"leyline:{self.session_id}"
        if share_exact and shared_namespace == self.namespace:
            raise ValueError(f"the shared namespace {shared_namespace!r} is the session's own")
        self.share_exact = share_exact
        self.shared_namespace = shared_namespace
        # NOTE: private: the session's KV is in its own namespace (it spliced or was forked, or
        # sharing is off); False: in shared_namespace, exact KV only.
        self.private = not share_exact
        self.splice_enabled = splice
        self.records: list[TurnRecord] = []
        self.messages: list[dict[str, Any]] = []
        # the previous turn's reply after wrapper.tokens: its ids, its length, or None: unknown
        self._reply: list[int] | int | None = 0
        self._moved: str | None = None  # why the session moved to another backend (next turn)
        self.pinned: PinResponse | None = None  # the session's one pin (``pin``)
        self.pins_replaced = 0  # previous pins ``pin`` released (not those expired first)

    @property
    def request_namespace(self) -> str:
        """The ``extra_key`` of the session's next request: its own once private, else the
        shared one."""
        return self.namespace if self.private else self.shared_namespace

    def set_cache_salt(self, cache_salt: str | None) -> None:
        """Use the client's ``cache_salt`` from this turn on. A changed salt is another cache
        namespace: nothing cached so far is reachable in it, so the session forgets its tokens
        (the turn is prefilled in full, no splice refers to the old namespace) and starts shared
        again."""
        cache_salt = cache_salt or None
        if cache_salt != self.cache_salt:
            self.cache_salt = cache_salt
            self.wrapper.reset()
            self._reply = 0
            self.private = not self.share_exact

    def move(self, client: LeylineClient, why: str) -> None:
        """Continue on another backend (``client``; the proxy's failover), which holds nothing
        of this namespace. The next turn sends no splice and is a cold prefill
        (``best_reused`` 0); if it is edited, it counts as a splice miss with reason
        ``failover`` (``splice_error``: ``why``). Its tokens stay, so the policy and the diff
        see the conversation unchanged. It starts shared again there."""
        self.client = client
        self._moved = why
        self.private = not self.share_exact
        self.pinned = None  # NOTE: on the old backend, until its TTL

    def adopt(self, parent: SessionCore) -> ForkResponse | None:
        """Start from ``parent``'s state (a fork; call on a new session, with ``parent`` idle).

        The next turn diffs against ``parent``'s history. A private parent's held tokens are
        first copied into this session's own namespace (``POST /leyline/fork``; the session is
        private from then on, so its splices never touch the parent's KV); a shared parent's are
        already in the shared namespace, which this session then uses too (None is returned).
        The salt is the parent's. Nothing is adopted when the fork is refused.

        Raises:
            ForkRejected: the backend refused the fork (e.g. 409: the parent's KV was evicted).
            ValueError: ``parent`` is this session, or lives in another shared namespace.
        """
        if parent is self or parent.namespace == self.namespace:
            raise ValueError("a session cannot fork from itself")
        if self.share_exact and parent.shared_namespace != self.shared_namespace:
            raise ValueError("the parent's exact KV is in another shared namespace")
        held = list(parent.wrapper.tokens)
        copied: ForkResponse | None = None
        private = not self.share_exact
        reply = parent._reply
        if held and (parent.private or private):
            copied = self.client.fork(
                held,
                extra_key=parent.request_namespace,
                target_extra_key=self.namespace,
                cache_salt=parent.cache_salt,
            )
            private, reply = True, 0  # NOTE: the fork copies the prompt, not the reply after it
        self.cache_salt = parent.cache_salt
        self.private = private
        self.wrapper.tokens = held
        self.wrapper._last = parent.wrapper._last
        self.wrapper._turn = parent.wrapper._turn
        self._reply = reply if held else 0
        self.messages = [dict(m) for m in parent.messages]
        return copied

    def forget(self) -> None:
        """Forget the session's tokens (the next turn is prefilled in full, no splice); the
        namespace may still hold them, so the next turn's ``best_reused`` is unbounded."""
        self.wrapper.reset()
        self._reply = None

    def pin(self, end: int | None = None, *, ttl_s: float = DEFAULT_TTL_S) -> PinResponse:
        """Keep the first ``end`` held tokens (None: all) resident for ``ttl_s`` seconds, in the
        session's request namespace. A session keeps one pin: the new one is made, then the
        previous one released (counted in ``pins_replaced``). Owner: the session's own
        namespace (``release_pins``).

        Raises:
            PinRejected: the backend refused (409 not cached, 422 TTL out of range, 429 the
                server's cap on pinned slots); the previous pin stays. Or the new pin was made
                (``pinned`` is it) and releasing the previous one failed: it expires with its
                TTL.
            ValueError: no token held up to ``end``.
        """
        tokens = self.wrapper.tokens[:end]
        if not tokens:
            raise ValueError("nothing held to pin")
        new = self.client.pin(
            tokens,
            ttl_s=ttl_s,
            extra_key=self.request_namespace,
            cache_salt=self.cache_salt,
            owner=self.namespace,
        )
        old, self.pinned = self.pinned, new
        if old is not None and old.pin_id != new.pin_id:
            try:
                self.pins_replaced += self.client.unpin(old.pin_id)
            except PinRejected as e:
                if e.status != 404:  # 404: it expired already
                    raise
        return new

    def pin_marked(self, pending: Pending, marker: Marker) -> PinResponse | None:
        """After ``finish``: pin the prompt up to the end of the marked message (``marker``,
        indices of the list given to ``begin``) for its TTL; None when nothing of it is held
        as planned (a resync, a failed request) or the policy dropped everything up to it.
        Raises as ``pin``."""
        plan = pending.plan
        end = marked_end(plan.spans, plan.sources, marker.message)
        if end == 0 or self.wrapper.tokens[:end] != plan.tokens[:end]:
            return None
        return self.pin(end, ttl_s=marker.ttl_s)

    def release_pins(self) -> int:
        """Release every pin of the session (owner: its namespace) on its backend; the number
        released. Raises ``PinRejected``."""
        self.pinned = None
        return self.client.unpin(owner=self.namespace)

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
        best = self.best_reused(plan)
        result: SpliceResponse | None = None
        error: str | None = None
        reason: str | None = None
        splice_ms = 0.0
        moved, self._moved = self._moved, None
        if moved is not None:  # NOTE: the new backend holds none of the session's KV
            best = 0
            if self.splice_enabled and plan.directives:
                error, reason = f"failover: {moved}", "failover"
        elif self.splice_enabled and plan.directives and self.wrapper.tokens:
            try:
                result = self.client.splice(
                    self.wrapper.tokens,
                    plan.directives,
                    extra_key=self.request_namespace,
                    cache_salt=self.cache_salt,
                    target_extra_key=None if self.private else self.namespace,
                )
                splice_ms = result.http_ms
            except SpliceRejected as e:
                error, reason = f"{e.status}: {e.message}", e.reason
                splice_ms = (time.perf_counter() - t0) * 1e3
        if result is not None:  # NOTE: the spliced sequence is in the session's own namespace
            self.private = True
        elif not self.private:  # NOTE: other sessions fill the shared namespace too
            best = len(plan.tokens)
        pending = Pending(plan, result, error, splice_ms, t0, reason, best, final=final)
        if result is not None:  # NOTE: the backend now holds the spliced prefix, whatever follows
            self.wrapper.commit(plan, plan.tokens[: len(plan.tokens) - len(plan.tail)])
            pending.committed = True
        return pending

    def chat_body(self, pending: Pending, body: Mapping[str, Any]) -> dict[str, Any]:
        """The chat-completions body to send: ``body`` with the planned (edited) messages and
        tools, in the session's request namespace (``request_namespace``)."""
        messages = pending.plan.messages + ([pending.final] if pending.final else [])
        out = Namespace(self.request_namespace, self.cache_salt).apply(
            {**body, "messages": messages}
        )
        if pending.plan.tools:
            out["tools"] = pending.plan.tools
        return out

    def best_reused(self, plan: TurnPlan) -> int:
        """An upper bound of this turn's reused tokens (``accounting.best_reused``) in the
        session's own namespace; ``begin`` lifts it to the whole prompt when the request goes to
        the shared namespace (another session may have cached any prefix of it)."""
        return best_reused(plan, self.wrapper.tokens, self._reply, splice=self.splice_enabled)

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
        completion_tokens: int | None = None,
        output_ids: Sequence[int] | None = None,
    ) -> TurnRecord:
        """Record the turn and set the session's tokens to what the backend holds.

        Args:
            cached_tokens: the backend's count (``usage.prompt_tokens_details.cached_tokens``).
            prompt_ids: the backend's prompt token ids, when it returned them: adopted when they
                differ from the plan's (a resync).
            error: the request failed after reaching the backend (recorded with the turn).
            prefilled: the backend prefilled the whole prompt (False: it holds the spliced
                prefix at most, e.g. a request refused or cut off before its first token).
            completion_tokens, output_ids: the reply's length or ids (None: unknown), for the
                next turn's ``best_reused``.
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
        record = TurnRecord.of(
            pending,
            turn=len(self.records),
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
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
        if held is not None:
            reply = list(output_ids) if output_ids is not None else completion_tokens
            self._reply = reply if held else None  # held == []: the backend holds unknown tokens
        elif pending.committed:
            self._reply = 0  # the spliced prefix, no reply after it
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
            extra_key=self.request_namespace,
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
            output_ids=out.output_ids,
        )
        return record, out
