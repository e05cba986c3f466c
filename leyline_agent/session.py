"""One conversation against a Leyline backend: policy → diff → splice → request → bookkeeping.

The single code path of the in-process API, the proxy (both through ``chat_turn.py``, the OpenAI
chat turn) and ``leyline replay``. Pure Python (httpx); no torch, no sglang. Per turn::

    pending = core.plan(messages, tools)    # policy + diff, nothing sent
    core.splice(pending)                    # POST /leyline/splice when there are directives
    ...send pending.plan.messages (chat) or pending.plan.tokens (/generate), namespaced...
    record = core.finish(pending, prompt_tokens=..., cached_tokens=..., request_ms=...)

``begin`` is ``plan`` then ``splice``. A splice that cannot run (backend restarted, entry evicted,
no plugin) is a miss (``record.splice_error``); the request is still sent. Where the KV lives is
``placement`` (``placement.py``); the pin is ``pins`` and forks ``retention.fork``.

The session's tokens follow the backend's cache, not the request's fate: a splice is committed at
once; the backend's own prompt ids (``finish(prompt_ids=...)``) are adopted when they differ.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from leyline_agent.accounting import SpliceOutcome, TurnRecord, best_reused
from leyline_agent.chat.seen import SeenMessages
from leyline_agent.client import LeylineClient, SpliceRejected
from leyline_agent.placement import DEFAULT_SHARED_NAMESPACE, Placement
from leyline_agent.placement import namespace as _namespace
from leyline_agent.policies.protocol import Policy
from leyline_agent.retention import SessionPins
from leyline_agent.token_changes import common_prefix
from leyline_agent.wire import splice_key, state_id
from leyline_agent.wrapper import ConversationWrapper, TurnPlan

# The previous turn's reply after ``wrapper.tokens``: its ids, its length, or None: unknown.
Reply = list[int] | int | None


@dataclass
class Pending:
    """A turn between ``plan`` and ``finish``."""

    plan: TurnPlan
    t_start: float
    splice: SpliceOutcome = SpliceOutcome()
    committed: bool = False  # the splice ran: the wrapper already holds the spliced prefix
    final: dict[str, Any] | None = None  # the assistant message continued (continue_final)

    @property
    def best_reused(self) -> int:
        return self.splice.best_reused


class SessionCore:
    """Policy, diff and splice for one session.

    Args:
        client: the backend; ``wrapper``: the session's policy, renderer and held tokens.
        session_id: stable id; the own namespace is ``leyline:<session_id>`` unless given.
        splice: send directives to ``/leyline/splice`` (False: the re-prefill arm).
        namespace, cache_salt, share_exact, shared_namespace: the ``Placement``'s ``own``,
            ``salt``, ``share_exact`` and ``shared``. Raises ``ValueError`` when sharing and
            ``shared_namespace`` is the own one.
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
        self.wrapper = wrapper
        self.session_id = session_id or uuid.uuid4().hex
        own = namespace or _namespace(self.session_id)
        self.placement = Placement(
            client, own, shared=shared_namespace, salt=cache_salt, share_exact=share_exact
        )
        self.pins = SessionPins(self.placement)
        self.seen = SeenMessages()  # the last request's messages, checked (``chat_turn``)
        self.splice_enabled = splice
        self.records: list[TurnRecord] = []
        # the versions the session's splices went through (wire.state_id), the last 64
        self.states: deque[dict[str, Any]] = deque(maxlen=64)
        self.messages: list[dict[str, Any]] = []
        self._reply: Reply = 0

    def set_cache_salt(self, cache_salt: str | None) -> None:
        """Use the client's ``cache_salt`` from this turn on. A changed salt is another namespace
        where nothing cached so far is reachable: the session forgets its tokens (a full
        prefill, no splice) and starts shared again."""
        if self.placement.set_salt(cache_salt):
            self.wrapper.reset()
            self._reply = 0

    def set_adapter(self, adapter: str | None) -> None:
        """Use the LoRA ``adapter`` the client's request names (``inband.lora_adapter``)
        from this turn on; the session's splices name it too, so their replacement prefill runs
        with it (``backends/sglang/lora.py``). A changed adapter is another namespace: as with a
        changed salt, the session forgets its tokens and starts shared again."""
        if self.placement.set_adapter(adapter):
            self.wrapper.reset()
            self._reply = 0

    def move(self, client: LeylineClient, why: str) -> None:
        """Continue on another backend (the proxy's failover), which holds nothing of this
        session: the next turn is a cold prefill (``best_reused`` 0), an edited one a miss with
        reason ``failover``; the tokens stay (the diff sees the conversation unchanged). Shared
        again there; the pin stays behind."""
        self.placement.move_to(client, why)
        self.pins.forget()

    def adopt(self, parent: SessionCore, *, copied: bool) -> None:
        """Take ``parent``'s conversation state (``retention.fork``, which copies the KV first):
        the next turn diffs against its history. ``copied``: the parent's held prompt was copied
        into this session's own namespace (private from now on; the reply after it is not)."""
        self.placement.adopt(parent.placement.salt, copied or not self.placement.share_exact)
        self.wrapper.adopt(parent.wrapper)
        held = bool(self.wrapper.tokens)
        self._reply = (0 if copied else parent._reply) if held else 0
        self.messages = [dict(m) for m in parent.messages]

    def forget(self) -> None:
        """Forget the session's tokens (the next turn: a full prefill, no splice, and an unbounded
        ``best_reused``: the namespace may still hold them)."""
        self.wrapper.reset()
        self._reply = None

    def plan(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None = None,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
        final: Mapping[str, Any] | None = None,
        continued: str | None = None,
        policy: Policy | None = None,
    ) -> Pending:
        """Policy and diff; nothing is sent.

        Args:
            template_kwargs: extra chat-template variables (see ``chat.request.template_kwargs``).
            final, continued: SGLang's ``continue_final_message``: the final assistant message,
                not rendered (sent after the planned messages), and its text, whose tokens are
                appended after the generation prompt.
            policy: this turn's own edits after the session's policy (``wrapper.plan``).

        Raises:
            PolicyError, DirectiveError, jinja2.TemplateError: as ``ConversationWrapper.plan``.
        """
        t0 = time.perf_counter()
        plan = self.wrapper.plan(
            messages, tools, template_kwargs=template_kwargs, extra_policy=policy
        )
        if continued:  # SGLang appends encode(text) to the prompt ids
            extra = self.wrapper.renderer.encode(continued)
            plan = replace(plan, tokens=[*plan.tokens, *extra], tail=[*plan.tail, *extra])
        # NOTE: a bound in the own namespace; ``splice`` lifts it to the whole prompt in the shared one
        bound = best_reused(plan, self.wrapper.tokens, self._reply, splice=self.splice_enabled)
        return Pending(plan, t0, SpliceOutcome(best_reused=bound), final=dict(final or {}) or None)

    def splice(self, pending: Pending) -> None:
        """Send the plan's directives to ``/leyline/splice`` (when enabled and there are any);
        a splice that ran is committed at once. A refused splice is recorded, not raised."""
        plan, where = pending.plan, self.placement
        best, error, reason, result, splice_ms = pending.splice.best_reused, None, None, None, 0.0
        held = 0  # the prefix a re-prefill would reuse, measured before the splice changes it
        moved = where.take_moved()
        if moved is not None:  # NOTE: the new backend holds none of the session's KV
            best = 0
            if self.splice_enabled and plan.directives:
                error, reason = f"failover: {moved}", "failover"
        elif self.splice_enabled and plan.directives and self.wrapper.tokens:
            held = common_prefix(self.wrapper.tokens, plan.tokens)
            try:
                parent = state_id(self.wrapper.tokens, where.extra_key, where.salt, where.adapter)
                result = where.client.splice(
                    self.wrapper.tokens, plan.directives, extra_key=where.extra_key,
                    cache_salt=where.salt, target_extra_key=where.splice_target(),
                    lora_path=where.adapter,
                    expected_state=parent,
                    idempotency_key=splice_key(parent, plan.directives, where.splice_target()),
                )  # fmt: skip
                splice_ms = result.http_ms
                self.states.append({
                    "turn": len(self.records), "parent_state_id": result.parent_state_id,
                    "state_id": result.state_id, "replayed": result.replayed,
                })  # fmt: skip
            except SpliceRejected as e:
                error, reason = f"{e.status}: {e.message}", e.reason
                splice_ms = (time.perf_counter() - pending.t_start) * 1e3
        if result is not None:  # NOTE: the spliced sequence is in the session's own namespace
            where.spliced()
        shared = result is None and not where.private
        if shared:  # NOTE: other sessions fill the shared namespace too
            best = len(plan.tokens)
        pending.splice = SpliceOutcome(result, error, reason, splice_ms, best, held, shared)
        if result is not None:  # NOTE: the backend now holds the spliced prefix, whatever follows
            self.wrapper.commit(plan, plan.tokens[: len(plan.tokens) - len(plan.tail)])
            pending.committed = True

    def begin(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None = None,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Pending:
        """``plan`` then ``splice``. Raises as ``plan``."""
        pending = self.plan(messages, tools, template_kwargs=template_kwargs)
        self.splice(pending)
        return pending

    def chat_body(self, pending: Pending, body: Mapping[str, Any]) -> dict[str, Any]:
        """The chat-completions body to send: ``body`` with the planned (edited) messages and
        tools, in the session's request namespace (``placement.request``)."""
        messages = pending.plan.messages + ([pending.final] if pending.final else [])
        out = self.placement.request.apply({**body, "messages": messages})
        if pending.plan.tools:
            out["tools"] = pending.plan.tools
        return out

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
            plan, pending.splice, turn=len(self.records), prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens, request_ms=request_ms, ttft_ms=ttft_ms,
            first_token=first_token, render_mismatch=mismatch, resynced=resynced, error=error,
        )  # fmt: skip
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
