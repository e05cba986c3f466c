"""The conversation wrapper: each turn's message list -> a policy's edits -> directives.

On every turn the agent hands over its full message list. The wrapper applies the policy to it,
renders the edited list with the model's chat template, and diffs the tokens against the previous
turn's prompt (what the server holds, ``diff.diff_rendered``): the result is a ``TurnPlan``, a
set of directives on the old tokens plus a tail of new tokens, with
``apply_directives(old, directives) + tail == tokens`` exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from leyline_agent.chat.model_dir import load_renderer
from leyline_agent.chat.render import Renderer
from leyline_agent.chat.render_cache import IncrementalRenderer
from leyline_agent.chat.spans import Rendered
from leyline_agent.diff import Diff, diff_rendered, diff_tokens, message_key
from leyline_agent.directive import Directive, Mode
from leyline_agent.messages import sent_message
from leyline_agent.policies.edits import EditResult, apply_edits
from leyline_agent.policies.protocol import (
    Chain,
    Conversation,
    Edit,
    LazyTokenCounts,
    Policy,
    carry_edits,
)
from leyline_agent.policies.registry import parse_policy

Message = dict[str, Any]


@dataclass(frozen=True)
class TurnPlan:
    """What to send for one turn.

    Attributes:
        messages: the edited message list (send these).
        tokens: the full prompt the edited list renders to.
        spans: token span of every message in ``tokens``.
        directives: edits of the previous prompt (``ConversationWrapper.tokens``), in order.
        tail: tokens appended after the edited previous prompt.
        edits: what the policy returned (indices into the incoming list).
        fallback: part of the diff was not explained by message edits (template instability or
            changed tools; see ``diff.Diff``). ``apply_directives(previous, directives) + tail
            == tokens`` holds for every plan (``diff_rendered`` verifies it).
        sources: per edited message, its index in the incoming list.
        base_len: length of the previous prompt the directives apply to (its first ``base_len``
            tokens: a generation prompt the new messages do not follow is ``dropped``).
        dropped: tokens at the end of the previous prompt left out of this one without a
            directive. The generation prompt (``<|im_start|>assistant\n``) is not history: when
            the next list does not carry a reply after it, the prefix before it is reused as a
            plain prefix hit (no splice).
        turn: index of this turn since the last reset.
        tools: the tool schemas rendered with the messages.
        keys: ``message_key`` of every message (what the next turn aligns against).
        incoming: the incoming list as cleaned for sending (``sent_message``), before the policy's
            edits: what the next turn's ``Conversation.previous`` carries ``edits`` against.
    """

    messages: list[Message]
    tokens: list[int]
    spans: list[tuple[int, int]]
    directives: list[Directive]
    tail: list[int]
    edits: list[Edit]
    fallback: bool
    sources: list[int] = field(default_factory=list)
    base_len: int = 0
    dropped: int = 0
    turn: int = 0
    tools: list[Any] | None = None
    keys: list[Hashable] = field(default_factory=list, repr=False, compare=False)
    incoming: list[Message] = field(default_factory=list, repr=False, compare=False)

    @property
    def reused(self) -> int:
        """Old tokens kept (outside every directive's span)."""
        return self.base_len - sum(d.removed for d in self.directives)


class ConversationWrapper:
    """Turn each turn's full message list into directives against the server's prompt.

    Args:
        renderer: a ``Renderer`` or a model directory; ``None`` = the embedded default model.
        policy: a ``Policy`` or a spec such as ``"stale_tool_outputs:keep_last=2"``.
        default_mode: mode for changes the policy did not make (the agent rewrote a message).
        incremental: render through an ``IncrementalRenderer`` (same tokens and spans; only new
            or changed messages are rendered and encoded). False: a full render every time.

    Usage::

        plan = wrapper.plan(messages, tools)   # pure
        ...send plan.directives + plan.tail (or plan.messages)...
        wrapper.commit(plan)                   # the server now holds plan.tokens
    """

    def __init__(
        self,
        renderer: Renderer | str | None = None,
        policy: Policy | str | None = "none",
        default_mode: Mode = Mode.AMORTIZE,
        incremental: bool = True,
    ) -> None:
        self.renderer = renderer if isinstance(renderer, Renderer) else load_renderer(renderer)
        self.incremental = IncrementalRenderer(self.renderer) if incremental else None
        self._render = self.incremental.render if self.incremental else self.renderer.render
        self.policy = parse_policy(policy)
        self.default_mode = Mode(default_mode)
        self._tokens: list[int] = []
        self._last: TurnPlan | None = None
        self._turn = 0
        self._holds_last = False  # self.tokens starts with the last plan's tokens

    @property
    def tokens(self) -> list[int]:
        """The prompt the server holds (the next plan's directives apply to it)."""
        return self._tokens

    @tokens.setter
    def tokens(self, tokens: Sequence[int]) -> None:
        self._tokens = list(tokens)
        self._holds_last = self._starts_with_last()

    def reset(self) -> None:
        """Forget the previous turn (the next plan is a full prefill)."""
        self._tokens, self._last, self._turn = [], None, 0

    def conversation(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
    ) -> Conversation:
        """The policy's view of an incoming message list."""
        incoming = [sent_message(m) for m in messages]
        return self._conversation(messages, incoming, lambda: self._render(incoming, tools))

    def _conversation(
        self,
        messages: Sequence[Mapping[str, Any]],
        incoming: Sequence[Message],
        rendered: Callable[[], Rendered],
    ) -> Conversation:
        last = self._last
        return Conversation(
            messages=list(messages),
            token_counts=LazyTokenCounts(len(incoming), lambda: rendered().spans),
            turn=self._turn,
            count_tokens=self.renderer.count,
            previous=carry_edits(last.incoming, last.edits, incoming) if last else (),
        )

    # Index spaces in ``plan()``:
    #   incoming i   the agent's list (``messages``); policy edits and ``EditResult.modes`` use it
    #   sent j       the edited list (``sent``); ``edited.sources[j]`` = its incoming index
    #   previous k   the last plan's sent list; ``last.sources[k]`` = its incoming index then
    #   tokens       positions in ``self.tokens`` (old) / ``rendered.tokens`` (new); spans map to them
    # ``new_modes[j]``: mode of the edits behind sent message j; ``old_modes[k]``: mode of the edit
    # that dropped previous message k (its incoming index kept, no sent message from it).
    def plan(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None = None,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
        extra_policy: Policy | None = None,
    ) -> TurnPlan:
        """Apply the policy, render, and diff against ``self.tokens`` (no state changes).

        ``template_kwargs``: extra chat-template variables (SGLang's ``chat_template_kwargs``);
        such turns are rendered in full. ``extra_policy``: this turn's own edits after the
        session's policy (``policies.Chain``; e.g. a request's Anthropic context editing).

        Raises:
            PolicyError: the policy returned invalid edits.
            jinja2.TemplateError: the chat template rejects the edited conversation.
        """

        def render(m: Sequence[Mapping[str, Any]], t: Sequence[Any] | None) -> Rendered:
            if template_kwargs:
                return self.renderer.render(m, t, template_kwargs=template_kwargs)
            return self._render(m, t)

        incoming = [sent_message(m) for m in messages]
        renders: list[Rendered] = []  # the incoming list's, once rendered

        def render_incoming() -> Rendered:
            if not renders:
                renders.append(render(incoming, tools))
            return renders[0]

        policy = self.policy if extra_policy is None else Chain((self.policy, extra_policy))
        edits = list(policy(self._conversation(messages, incoming, render_incoming)))
        # NOTE: no edits, no copies: every sent message is the incoming one.
        n = len(incoming)
        edited = apply_edits(messages, edits) if edits else EditResult(incoming, [*range(n)], {})
        sent = [  # messages no edit touched are the incoming ones, already cleaned
            sent_message(m) if i in edited.modes else incoming[i]
            for m, i in zip(edited.messages, edited.sources, strict=True)
        ]
        # NOTE: the incoming list is rendered only when a policy read its token counts or when
        # it is what is sent.
        rendered = render(sent, tools) if sent != incoming else render_incoming()
        last = self._last
        # NOTE: keys of messages equal to the last plan's at the same index are its keys (the
        # same test the incremental renderer reuses text by); only the others are serialised
        # (a first message rewritten every turn leaves the rest unchanged).
        lk = last.keys if last is not None else []
        lm = last.messages if last is not None and lk else []
        keys = [
            lk[j] if j < len(lm) and (lm[j] is m or lm[j] == m) else message_key(m)
            for j, m in enumerate(sent)
        ]
        if last is not None and self._holds_last:
            kept = set(edited.sources)
            new_modes = [edited.modes.get(i) for i in edited.sources]
            old_modes = [edited.modes.get(i) if i not in kept else None for i in last.sources]
            diff = diff_rendered(
                last.messages,
                Rendered(self.tokens, last.spans),
                sent,
                rendered,
                old_modes=old_modes,
                new_modes=new_modes,
                default_mode=self.default_mode,
                tools_changed=last.tools != (list(tools) if tools else None),
                old_keys=last.keys or None,
                new_keys=keys,
                # NOTE: self.tokens starts with last.tokens (_holds_last): the runs the renderer
                # copied from those are equal in both (O(change) checks in the diff).
                known=self.incremental.copied(rendered, last.tokens) if self.incremental else (),
            )
        else:
            diff = diff_tokens(self.tokens, rendered.tokens, self.default_mode)
        base = len(self.tokens)
        opener = last.spans[-1][1] if last is not None and last.spans else base
        if (
            diff.directives
            and diff.directives[-1].end == base
            and diff.directives[0].start >= opener
        ):
            # NOTE: only the generation prompt (after the last old message) changes: the tokens
            # before the first directive are a prefix of the new prompt, a plain prefix hit.
            base = diff.directives[0].start
            diff = Diff([], list(rendered.tokens[base:]), diff.fallback)
        return TurnPlan(
            messages=sent,
            tokens=rendered.tokens,
            spans=rendered.spans,
            directives=diff.directives,
            tail=diff.tail,
            edits=edits,
            fallback=diff.fallback,
            sources=edited.sources,
            base_len=base,
            dropped=len(self.tokens) - base,
            turn=self._turn,
            tools=list(tools) if tools else None,
            keys=keys,
            incoming=incoming,
        )

    def commit(self, plan: TurnPlan, tokens: Sequence[int] | None = None) -> None:
        """Record that the server now holds ``plan.tokens`` (or ``tokens``: what it really
        holds for this plan's messages, e.g. the backend's own rendering, or only the spliced
        prefix when the request after the splice failed).

        A plan whose tokens the server does not hold exactly is diffed by tokens next turn.

        Raises:
            ValueError: ``plan`` was made against a different previous prompt.
        """
        held = len(self.tokens)
        if plan.base_len + plan.dropped != held:
            raise ValueError(
                f"plan was made against {plan.base_len} tokens, the wrapper holds {held}"
            )
        self._last = plan
        self._turn += 1
        if tokens is None:
            self._tokens, self._holds_last = list(plan.tokens), True
        else:
            self.tokens = tokens

    def adopt(self, other: ConversationWrapper) -> None:
        """Continue from ``other``'s state (a fork): its held tokens, last plan and turn count;
        the next plan diffs against them."""
        self._last, self._turn = other._last, other._turn
        self._tokens, self._holds_last = list(other.tokens), other._holds_last

    def hold(self, tokens: Sequence[int]) -> None:
        """Record that the server now holds ``tokens`` for the last committed plan (a turn
        committed at its splice whose request then prefilled more, or other tokens)."""
        self.tokens = tokens

    def _starts_with_last(self) -> bool:
        """``self.tokens`` starts with the last plan's tokens (computed when they are set, so
        that planning a turn compares nothing of the held prompt)."""
        last = self._last
        return last is not None and self.tokens[: len(last.tokens)] == last.tokens
