"""Incremental rendering: ``Renderer.render`` that re-renders and re-tokenizes only what changed.

``IncrementalRenderer.render(messages, tools)`` returns what ``Renderer.render`` returns (same
text, token ids and spans) from a few remembered renders (``states``): it picks the one sharing
the longest message prefix with the new list and redoes only the rest.

Text (local templates only). A template is *local* when every message's rendering depends only
on itself, the previous message, what follows it, ``messages[0]`` and the tools (ChatML: the
system block, tool outputs grouped under one ``user`` turn). Then, with the first ``m`` messages
unchanged (``m >= 3``), the text up to message ``m - 1``'s raw boundary is the old one and the
rest is cut from a render of the window ``[messages[0], messages[m-2], *messages[m-1:]]``
(boundaries by the same prefix renders, on the window). Locality is decided once per renderer:
a static screen of the template source (no ``namespace``, ``length``, ``revindex``, ...) and a
probe check (windowed == full render on synthetic conversations with and without tools, system
message, parallel and consecutive tool calls, edits). Other templates are rendered in full.

Tokens. Pre-tokenization never crosses a special token: the tokenizer splits the text at added
tokens first and encodes the pieces independently. So where the old and new texts agree up to
the end of a special token, the old ids up to it are the new ids' prefix, and only the text
after it is encoded. This holds when no special token has ``lstrip``/``rstrip``/``single_word``
set, none overlaps another (no suffix of one is a prefix or infix of another), and the
pre-tokenizer has no first-piece-only behaviour (``Metaspace`` with ``prepend_scheme: first``);
checked once per tokenizer, else the whole text is encoded.

Boundaries are clamped to the contents as ``clamp_to_contents`` does; contents found wholly
inside the unchanged text keep their positions and clamped boundaries (``Found.need``).

Messages are compared with ``==`` (values equal in Python but rendered differently, such as ``1``
and ``1.0``, count as the same); remembered messages are copies, so mutating a message after
rendering it cannot make a stale render look current. Treat the returned ``Rendered`` as
read-only: it may be returned again for the same list.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from copy import deepcopy
from functools import cached_property
from typing import Any, NamedTuple

from tokenizers import Tokenizer

from leyline_agent.render import (
    Found,
    Message,
    Rendered,
    Renderer,
    _common_prefix_len,
    clamp_bounds,
    content_positions,
    token_spans,
)

# The static screen. Message-relative forms are allowed (ChatML: the previous and next message,
# whether this is the first); any other use of the loop index or of the list as a whole (its
# length, filters over it, negative or sliced indexing, a second loop over it), a namespace
# (state carried across messages) or the clock makes a template non-local.
_ALLOWED = re.compile(
    r"messages\s*\[\s*(0|loop\.index0\s*[-+]\s*1)\s*\]|loop\.index0\s*(==|>|!=)\s*0\b"
)
_NONLOCAL = re.compile(
    r"namespace|length|loop\.(?!first\b|last\b)|messages\s*[\[|]|strftime|reverse"
)
_LOOPS = re.compile(r"\bin\s+messages\b")


def _screened(source: str) -> bool:
    """The template source passes the static screen (see above)."""
    return len(_LOOPS.findall(source)) <= 1 and not _NONLOCAL.search(_ALLOWED.sub("", source))


_MAX_PIECES = 4096  # remembered encoded pieces (about two messages each)


class _State(NamedTuple):
    messages: list[Message]
    tools: list[Any] | None
    add_generation_prompt: bool
    text: str
    raw: list[int]  # boundaries before clamping
    tokens: list[int]
    starts: list[int]  # first character of every token
    cuts: list[int]  # token indices right after a special token (sorted)
    rendered: Rendered
    bounds: list[int]  # clamped
    found: list[Found | None]  # content_positions
    need: list[int]  # running maximum of found[k].need (0 for None)
    pos: list[int]  # search position before each message, then after the last


def _frozen(message: Message) -> Message:
    """A copy the caller cannot change by mutating its message (nested values copied)."""
    return {
        k: v if isinstance(v, str | int | float | None) else deepcopy(v) for k, v in message.items()
    }


def _common_messages(a: Sequence[Message], b: Sequence[Message]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and (a[i] is b[i] or a[i] == b[i]):
        i += 1
    return i


def _probe_conversations() -> list[list[dict[str, Any]]]:
    def call(i: int) -> dict[str, Any]:
        args = json.dumps({"path": f"f{i}.py"})
        return {"id": f"c{i}", "type": "function", "function": {"name": "view", "arguments": args}}

    body: list[dict[str, Any]] = [{"role": "user", "content": "Fix the test."}]
    for i in range(2):
        body.append({"role": "assistant", "content": f"step {i}", "tool_calls": [call(i)]})
        body.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"out {i}\nx"})
    body.append({"role": "assistant", "content": "", "tool_calls": [call(7), call(8)]})
    body += [{"role": "tool", "tool_call_id": f"c{i}", "content": ""} for i in (7, 8)]
    body += [{"role": "user", "content": "go on"}, {"role": "assistant", "content": "ok"}]
    body += [
        {"role": "user", "content": "a"},
        {"role": "tool", "tool_call_id": "c9", "content": "b"},
    ]
    return [[{"role": "system", "content": "Be careful."}, *body], body]


def full_text(
    renderer: Renderer, messages: Sequence[Message], tools: Sequence[Any] | None, agp: bool
) -> tuple[str, list[int]]:
    """The prompt text and its raw boundaries, rendered in full."""
    text = renderer.render_text(messages, tools, agp)
    return text, renderer.raw_bounds(messages, tools, text)


def splice_window(
    old_text: str, old_raw: list[int], m: int, text_w: str, raw_w: list[int]
) -> tuple[str, list[int]]:
    """Text and raw boundaries of a list whose first ``m >= 3`` messages are the old ones', from
    the old render and the render of the window ``[msgs[0], msgs[m-2], *msgs[m-1:]]``: the old
    text up to message ``m - 1``, then the window's from its third message on."""
    cut, cut_w = old_raw[m - 1], raw_w[2]
    return old_text[:cut] + text_w[cut_w:], old_raw[: m - 1] + [cut + b - cut_w for b in raw_w[2:]]


def is_local(renderer: Renderer) -> bool:
    """The renderer's chat templates pass the static screen and the probe check."""
    sources = renderer.chat_templates.values()
    if not all(_screened(src) for src in sources):
        return False
    tools = [{"type": "function", "function": {"name": "view", "parameters": {}}}]
    try:
        return all(_probe(renderer, c, t) for c in _probe_conversations() for t in (None, tools))
    except Exception:  # noqa: BLE001 - a template that rejects the probes is not known local
        return False


def _probe(renderer: Renderer, conv: list[Message], tools: list[Any] | None) -> bool:
    """Windowed == full render for appends of one and two messages at every length, and for an
    edit and a removal at every position of the whole conversation."""
    full = [full_text(renderer, conv[:n], tools, True) for n in range(len(conv) + 1)]
    n = len(conv)
    cases = [(k, conv[:j], full[j]) for j in range(4, n + 1) for k in (j - 2, j - 1) if k >= 3]
    for m in range(3, n):
        for new in (
            [*conv[:m], {**conv[m], "content": "changed"}, *conv[m + 1 :]],
            conv[:m] + conv[m + 1 :],
        ):
            cases.append((n, new, full_text(renderer, new, tools, True)))
    for k, new, expected in cases:
        m = _common_messages(conv[:k], new)
        window = [new[0], new[m - 2], *new[m - 1 :]]
        got = splice_window(*full[k], m, *full_text(renderer, window, tools, True))
        if got != expected:
            return False
    return True


def cut_token_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Special tokens after which a text can be encoded in two pieces (empty: none)."""
    added = tokenizer.get_added_tokens_decoder()
    if any(a.lstrip or a.rstrip or a.single_word for a in added.values()):
        return frozenset()
    pre = tokenizer.pre_tokenizer
    if pre is not None and re.search(
        r'"prepend_scheme"\s*:\s*"first"', pre.__getstate__().decode()
    ):
        return frozenset()
    specials = {i: a.content for i, a in added.items() if a.special and a.content}
    contents = [a.content for a in added.values() if a.content]
    for a in contents:
        for b in contents:
            if a != b and (a in b or any(a.endswith(b[:j]) for j in range(1, len(b)))):
                return frozenset()
    return frozenset(specials)


class IncrementalRenderer:
    """``Renderer.render`` with reuse of earlier renders (see module docstring).

    Args:
        renderer: the renderer whose output this reproduces exactly.
        states: how many earlier renders to remember (a wrapper renders two lists per turn:
            the incoming one and the edited one).
        local: force the locality decision (None: screen + probe check).
    """

    def __init__(self, renderer: Renderer, states: int = 4, local: bool | None = None) -> None:
        self.renderer = renderer
        self.max_states = states
        self._states: list[_State] = []
        self._local = local
        self._pieces: dict[str, tuple[list[int], list[int]]] = {}

    @cached_property
    def _cuts(self) -> tuple[frozenset[int], re.Pattern[str] | None]:
        """Cut-point special tokens and a pattern finding them (None: encode texts whole)."""
        ids = self.renderer.incremental_checks[1]
        vocab = self.renderer.tokenizer.get_added_tokens_decoder()
        contents = sorted((vocab[i].content for i in ids), key=len, reverse=True)
        return ids, re.compile("|".join(map(re.escape, contents))) if contents else None

    @property
    def local(self) -> bool:
        """Whether renders after the first few messages are windowed (see module docstring)."""
        if self._local is None:
            self._local = self.renderer.incremental_checks[0]
        return self._local

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> Rendered:
        """Exactly ``Renderer.render(messages, tools, add_generation_prompt)``.

        Raises:
            jinja2.TemplateError: the template rejects the conversation.
        """
        messages = list(messages)
        tools_l = list(tools) if tools is not None else None
        best, m = None, -1
        for s in self._states:
            if s.tools == tools_l and s.add_generation_prompt == add_generation_prompt:
                k = _common_messages(s.messages, messages)
                if k > m:
                    best, m = s, k
        if best is not None and m == len(messages) == len(best.messages):
            self._remember(best, best)
            return best.rendered
        found, need, pos, start = [], [], [0], 0
        if best is not None and m >= 3 and self.local:
            window = [messages[0], messages[m - 2], *messages[m - 1 :]]
            text_w, raw_w = full_text(self.renderer, window, tools, add_generation_prompt)
            text, raw = splice_window(best.text, best.raw, m, text_w, raw_w)
            # Contents found wholly inside the unchanged text are found there again, and the
            # boundaries clamped by them stay (see ``Found.need``).
            start = min(bisect_right(best.need, best.raw[m - 1]), m - 1)
            found, need, pos = best.found[:start], best.need[:start], best.pos[: start + 1]
        else:
            text, raw = full_text(self.renderer, messages, tools, add_generation_prompt)
        tokens, starts, cuts = self._encode(text, best)
        at = pos[-1]
        for f in content_positions(messages[start:], text, at):
            found.append(f)
            need.append(max(need[-1] if need else 0, f.need if f is not None else 0))
            at = f.end if f is not None and f.at >= 0 else at
            pos.append(at)
        bounds = [*best.bounds[:start], *raw[start:]] if start else list(raw)
        clamp_bounds(bounds, found, len(text), start)
        rendered = Rendered(tokens, token_spans(starts, bounds), text)
        kept = best.messages[:m] if best is not None and m > 0 else []
        state = _State(
            [*kept, *map(_frozen, messages[len(kept) :])],
            tools_l,
            add_generation_prompt,
            text,
            raw,
            tokens,
            starts,
            cuts,
            rendered,
            bounds,
            found,
            need,
            pos,
        )
        self._remember(best, state)
        return rendered

    def _encode(self, text: str, base: _State | None) -> tuple[list[int], list[int], list[int]]:
        """Token ids, token starts and cut points of ``text``: ``base``'s ids up to the last cut
        inside the text both agree on, then piece by piece (a piece ends after a special token),
        each piece's ids remembered."""
        cut_ids, splitter = self._cuts
        i = p = j = 0
        tokens: list[int] = []
        starts: list[int] = []
        cuts: list[int] = []
        if base is not None and cut_ids:
            agree = _common_prefix_len(base.text, text)
            # NOTE: token i - 1 ends where token i starts; a cut at i is reusable when that end
            # lies inside the agreeing prefix (the whole old text counts as ending at its length).
            q = (
                len(base.starts) + 1
                if agree == len(base.text)
                else bisect_right(base.starts, agree)
            )
            j = bisect_left(base.cuts, q)
            if j:
                i = base.cuts[j - 1]
                p = base.starts[i] if i < len(base.starts) else len(base.text)
                tokens, starts, cuts = base.tokens[:i], base.starts[:i], base.cuts[:j]
        ends = [m.end() for m in splitter.finditer(text, p)] if splitter else []
        if not ends or ends[-1] != len(text):
            ends.append(len(text))
        if len(self._pieces) > _MAX_PIECES:
            self._pieces.clear()
        for end in ends:
            piece = text[p:end]
            hit = self._pieces.get(piece)
            if hit is None:
                enc = self.renderer.tokenizer.encode(piece, add_special_tokens=False)
                hit = self._pieces[piece] = (enc.ids, [s for s, _ in enc.offsets])
            ids, local = hit
            if ids and ids[-1] in cut_ids:
                cuts.append(len(tokens) + len(ids))
            tokens += ids
            starts += [p + s for s in local]
            p = end
        return tokens, starts, cuts

    def _remember(self, used: _State | None, state: _State) -> None:
        """Most recent first: the new state, then the one it was made from, then the rest."""
        rest = [s for s in self._states if s is not used and s is not state]
        self._states = [state, *([used] if used is not None and used is not state else []), *rest]
        del self._states[self.max_states :]
