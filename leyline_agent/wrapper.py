"""The conversation wrapper: each turn's message list -> a policy's edits -> directives.

On every turn the agent hands over its full message list. The wrapper applies the policy to it,
renders the edited list with the model's chat template, and diffs the tokens against the previous
turn's prompt (what the server holds): the result is a set of directives on the old tokens plus a
tail of new tokens, with ``apply_directives(old, directives) + tail == tokens`` exactly.

Diff rule (``diff_rendered``):

1. Align old and new messages (difflib on the messages themselves). Messages appended at the end
   are the tail's; the old generation prompt (``<|im_start|>assistant\\n``) is kept as far as it
   agrees with the start of what follows it now.
2. Aligned messages map old token ranges (their spans) to new ones, message by message where
   the counts allow. An unchanged message whose tokens nonetheless differ (a template that
   re-renders earlier messages differently) counts as changed and sets ``fallback``; so does a
   changed preamble (unless the tools changed).
3. Each changed range is trimmed by its longest common token prefix and suffix and becomes one
   directive that touches only the differing tokens (directives that touch merge). Its mode is
   the strongest mode of the policy edits behind it; a change no edit made (the agent rewrote a
   message) gets the wrapper's ``default_mode``.
4. The result is verified; if it ever failed, one directive from the first differing token
   replaces the rest (``fallback``), which is exact by construction.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from leyline_agent.directive import Directive, Mode, sort_and_check
from leyline_agent.policies.base import (
    Conversation,
    Edit,
    Policy,
    apply_edits,
    message_text,
    parse_policy,
    stronger,
)
from leyline_agent.render import Rendered, Renderer, load_renderer
from leyline_agent.render_cache import IncrementalRenderer

Message = dict[str, Any]


class Diff(NamedTuple):
    """Directives on the old tokens plus the appended tail.

    fallback: some tokens differed where the messages did not (template instability or changed
        tools), or the span alignment failed and one covering directive was used.
    """

    directives: list[Directive]
    tail: list[int]
    fallback: bool


class _Region(NamedTuple):
    old_start: int
    old_end: int
    new_start: int
    new_end: int
    mode: Mode | None  # None: unchanged tokens


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _common_suffix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    i = 0
    while i < limit and a[len(a) - 1 - i] == b[len(b) - 1 - i]:
        i += 1
    return i


def diff_tokens(old: Sequence[int], new: Sequence[int], mode: Mode = Mode.AMORTIZE) -> Diff:
    """Token-only diff: keep the common prefix, one directive drops the rest of ``old``.

    For callers without message spans. ``fallback`` is set when ``old`` is not a prefix of
    ``new``.
    """
    p = _common_prefix(old, new)
    if p == len(old):
        return Diff([], list(new[p:]), False)
    return Diff([Directive(start=p, end=len(old), mode=mode)], list(new[p:]), True)


_KEY_ENCODER = json.JSONEncoder(sort_keys=True, default=str)


def message_key(message: Mapping[str, Any]) -> Hashable:
    """What message alignment compares: ``json.dumps(message, sort_keys=True, default=str)``."""
    return _KEY_ENCODER.encode(message)


def _edited(tokens: Sequence[int], directives: Sequence[Directive]) -> list[int]:
    """``apply_directives(tokens, directives)``, by slices (same checks, same result)."""
    out: list[int] = []
    pos = 0
    for d in sort_and_check(directives, len(tokens)):
        out += tokens[pos : d.start]
        out += d.replacement
        pos = d.end
    out += tokens[pos:]
    return out


def align_messages(
    old: Sequence[Mapping[str, Any]],
    new: Sequence[Mapping[str, Any]],
    old_keys: Sequence[Hashable] | None = None,
    new_keys: Sequence[Hashable] | None = None,
) -> list[tuple[str, int, int, int, int]]:
    """difflib opcodes between two message lists; messages appended after the last old one get
    their own trailing ``insert`` (a changed last message is paired with the first new one).
    ``old_keys``/``new_keys``: the lists' ``message_key``s where already known."""
    ops = difflib.SequenceMatcher(
        None,
        old_keys if old_keys is not None else [message_key(m) for m in old],
        new_keys if new_keys is not None else [message_key(m) for m in new],
        autojunk=False,
    ).get_opcodes()
    if ops and ops[-1][0] == "replace" and ops[-1][2] == len(old):
        tag, i1, i2, j1, j2 = ops.pop()
        k = min(i2 - i1, j2 - j1)
        ops.append(("replace", i1, i2, j1, j1 + k))
        if j1 + k < j2:
            ops.append(("insert", i2, i2, j1 + k, j2))
    return ops


def _bounds(rendered: Rendered) -> list[int]:
    """Token index where each message starts, then where the last one ends."""
    if not rendered.spans:
        return [0]
    return [s for s, _ in rendered.spans] + [rendered.spans[-1][1]]


def diff_rendered(
    old_messages: Sequence[Mapping[str, Any]],
    old: Rendered | Sequence[int],
    new_messages: Sequence[Mapping[str, Any]],
    new: Rendered,
    *,
    old_spans: Sequence[tuple[int, int]] | None = None,
    mode_of: Callable[[int, int, int, int], Mode | None] | None = None,
    default_mode: Mode = Mode.AMORTIZE,
    tools_changed: bool = False,
    old_keys: Sequence[Hashable] | None = None,
    new_keys: Sequence[Hashable] | None = None,
) -> Diff:
    """The minimal directives that turn the old prompt into the new one's prefix, plus the tail.

    Args:
        old_messages, old: the previous turn's messages and prompt (``Rendered``, or its tokens
            with ``old_spans``); the old tokens may extend past the old prompt (e.g. with the
            generated reply the server also holds).
        new_messages, new: this turn's.
        mode_of: ``(i1, i2, j1, j2) -> Mode | None``: the mode of the edits behind old messages
            ``[i1, i2)`` becoming new messages ``[j1, j2)`` (None: no edit made that change).
        default_mode: mode of changes no edit accounts for.
        tools_changed: the tool schemas changed, so unchanged messages may render differently
            (the tools block) without that being a fallback.
        old_keys, new_keys: the lists' ``message_key``s where already known.

    Returns:
        ``Diff`` with ``apply_directives(old_tokens, directives) + tail == new.tokens``.
    """
    old_tokens = list(old.tokens if isinstance(old, Rendered) else old)
    spans = list(old.spans if isinstance(old, Rendered) else old_spans or [])
    ob = _bounds(Rendered(old_tokens, spans))
    nb = _bounds(new)
    N = new.tokens
    fallback = False
    regions: list[_Region] = []

    def add(a: int, b: int, c: int, d: int, mode: Mode | None, same_messages: bool) -> None:
        nonlocal fallback
        if mode is None and old_tokens[a:b] != N[c:d]:
            mode, fallback = default_mode, fallback or (same_messages and not tools_changed)
        regions.append(_Region(a, b, c, d, mode))

    if not old_messages or not new_messages:
        ob, nb = [0] * (len(old_messages) + 1), [0] * (len(new_messages) + 1)
    add(0, ob[0], 0, nb[0], None, True)  # template preamble
    j_app = len(new_messages)
    for tag, i1, i2, j1, j2 in align_messages(old_messages, new_messages, old_keys, new_keys):
        if tag == "insert" and i1 == len(old_messages):
            j_app = j1
            break
        pairs = [(i1 + t, i1 + t + 1, j1 + t, j1 + t + 1) for t in range(i2 - i1)]
        if i2 - i1 != j2 - j1:
            pairs = [(i1, i2, j1, j2)]
        for a, b, c, d in pairs:  # message by message where the counts allow
            if tag == "equal":
                add(ob[a], ob[b], nb[c], nb[d], None, True)
            else:
                mode = (mode_of(a, b, c, d) if mode_of else None) or default_mode
                add(ob[a], ob[b], nb[c], nb[d], mode, False)
    # The old generation prompt (and anything after it) against what now follows.
    g_start, r_start = ob[len(old_messages)], nb[j_app]
    g = _common_prefix(old_tokens[g_start:], N[r_start:])
    add(g_start, g_start + g, r_start, r_start + g, None, False)
    add(g_start + g, len(old_tokens), r_start + g, r_start + g, None, False)
    tail = list(N[r_start + g :])

    directives = _directives(old_tokens, N, regions)
    if _edited(old_tokens, directives) + tail != N:  # never expected; stay exact
        d = diff_tokens(old_tokens, N, default_mode)
        return Diff(d.directives, d.tail, True)
    return Diff(directives, tail, fallback)


def _directives(old: list[int], new: list[int], regions: list[_Region]) -> list[Directive]:
    """One directive per changed region, trimmed to the tokens that differ; touching ones merge."""
    out: list[Directive] = []
    for a, b, c, d, mode in regions:
        if mode is None:
            continue
        k = _common_prefix(old[a:b], new[c:d])
        k2 = _common_suffix(old[a + k : b], new[c + k : d], min(b - a, d - c) - k)
        if b - a == k + k2 and d - c == k + k2:
            continue
        start, end, repl = a + k, b - k2, tuple(new[c + k : d - k2])
        if out and out[-1].end == start:  # touching (or two insertions at one point): merge
            prev = out.pop()
            start, repl, mode = prev.start, prev.replacement + repl, stronger(prev.mode, mode)
        out.append(Directive(start=start, end=end, replacement=repl, mode=mode or Mode.AMORTIZE))
    return out


def _clean(message: Mapping[str, Any]) -> Message:
    """The message as sent: ``leyline_*`` annotations removed, text-part lists joined into one
    string (so that the server and the wrapper cannot join them differently)."""
    out = dict(message)
    for key in message:
        if key.startswith("leyline_"):
            del out[key]
    content = out.get("content")
    if isinstance(content, list) and all(
        isinstance(p, str) or (isinstance(p, dict) and p.get("type") == "text") for p in content
    ):
        out["content"] = message_text(out)
    return out


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
        exact: ``apply_directives(previous, directives) + tail == tokens`` (verified).
        fallback: part of the diff was not explained by message edits (see ``Diff``).
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
    """

    messages: list[Message]
    tokens: list[int]
    spans: list[tuple[int, int]]
    directives: list[Directive]
    tail: list[int]
    edits: list[Edit]
    exact: bool
    fallback: bool
    sources: list[int] = field(default_factory=list)
    base_len: int = 0
    dropped: int = 0
    turn: int = 0
    tools: list[Any] | None = None
    keys: list[Hashable] = field(default_factory=list, repr=False, compare=False)

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
        self.tokens: list[int] = []
        self._last: TurnPlan | None = None
        self._turn = 0

    def reset(self) -> None:
        """Forget the previous turn (the next plan is a full prefill)."""
        self.tokens, self._last, self._turn = [], None, 0

    def conversation(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
    ) -> Conversation:
        """The policy's view of an incoming message list."""
        return self._conversation(messages, self._render([_clean(m) for m in messages], tools))

    def _conversation(
        self, messages: Sequence[Mapping[str, Any]], rendered: Rendered
    ) -> Conversation:
        return Conversation(
            messages=list(messages),
            token_counts=[e - s for s, e in rendered.spans],
            turn=self._turn,
            count_tokens=self.renderer.count,
        )

    def plan(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None = None,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> TurnPlan:
        """Apply the policy, render, and diff against ``self.tokens`` (no state changes).

        ``template_kwargs``: extra chat-template variables (SGLang's ``chat_template_kwargs``);
        such turns are rendered in full.

        Raises:
            PolicyError: the policy returned invalid edits.
            jinja2.TemplateError: the chat template rejects the edited conversation.
        """
        render = self._render
        if template_kwargs:

            def render(m: Sequence[Mapping[str, Any]], t: Sequence[Any] | None) -> Rendered:
                return self.renderer.render(m, t, template_kwargs=template_kwargs)

        incoming = [_clean(m) for m in messages]
        rendered = render(incoming, tools)
        edits = list(self.policy(self._conversation(messages, rendered)))
        edited = apply_edits(messages, edits)
        sent = [  # messages no edit touched are the incoming ones, already cleaned
            _clean(m) if i in edited.modes else incoming[i]
            for m, i in zip(edited.messages, edited.sources, strict=True)
        ]
        if sent != incoming:
            rendered = render(sent, tools)
        keys = [message_key(m) for m in sent]
        last = self._last
        if last is not None and self.tokens[: len(last.tokens)] == last.tokens:
            removed_mode = {
                k: edited.modes[s]
                for k, s in enumerate(last.sources)
                if s in edited.modes and s not in edited.sources
            }

            def mode_of(i1: int, i2: int, j1: int, j2: int) -> Mode | None:
                mode: Mode | None = None
                for j in range(j1, j2):
                    mode = stronger(mode, edited.modes.get(edited.sources[j]))
                for i in range(i1, i2):
                    mode = stronger(mode, removed_mode.get(i))
                return mode

            diff = diff_rendered(
                last.messages,
                Rendered(self.tokens, last.spans),
                sent,
                rendered,
                mode_of=mode_of,
                default_mode=self.default_mode,
                tools_changed=last.tools != (list(tools) if tools else None),
                old_keys=last.keys or None,
                new_keys=keys,
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
        exact = _edited(self.tokens[:base], diff.directives) + diff.tail == rendered.tokens
        return TurnPlan(
            messages=sent,
            tokens=rendered.tokens,
            spans=rendered.spans,
            directives=diff.directives,
            tail=diff.tail,
            edits=edits,
            exact=exact,
            fallback=diff.fallback,
            sources=edited.sources,
            base_len=base,
            dropped=len(self.tokens) - base,
            turn=self._turn,
            tools=list(tools) if tools else None,
            keys=keys,
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
        self.tokens = list(plan.tokens if tokens is None else tokens)
        self._last = plan
        self._turn += 1

    def hold(self, tokens: Sequence[int]) -> None:
        """Record that the server now holds ``tokens`` for the last committed plan (a turn
        committed at its splice whose request then prefilled more, or other tokens)."""
        self.tokens = list(tokens)
