"""Incremental rendering: ``Renderer.render`` that re-renders and re-tokenizes only what changed.

``IncrementalRenderer.render(messages, tools)`` returns what ``Renderer.render`` returns (same
text, token ids and spans) from a few remembered renders (``states``): it picks the one sharing
the longest message prefix with the new list and redoes only the rest.

Text: for a local template (``chat.locality``) the rest is cut from a render of a window of the
messages; other templates are rendered in full. Tokens: where the old and new texts agree up to
the end of a cut-point special token (``chat.locality.cut_token_ids``), the old ids up to it are
the new ids' prefix, and only the text after it is encoded, piece by piece.

Boundaries are clamped to the contents as ``clamp_to_contents`` does; contents found wholly
inside the unchanged text keep their positions and clamped boundaries (``Found.need``).

Messages are compared with ``==`` (values equal in Python but rendered differently, such as ``1``
and ``1.0``, count as the same); remembered messages are copies, so mutating a message after
rendering it cannot make a stale render look current. Treat the returned ``Rendered`` as
read-only: it may be returned again for the same list.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from copy import deepcopy
from functools import cached_property
from typing import Any, NamedTuple

from leyline_agent.chat.locality import common_messages, full_text, splice_window
from leyline_agent.chat.render import Renderer
from leyline_agent.chat.spans import (
    Found,
    Message,
    Rendered,
    clamp_bounds,
    common_prefix_len,
    content_positions,
    token_spans,
)

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
                k = common_messages(s.messages, messages)
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
        bounds = [*best.bounds[:start], *raw[start:]] if best is not None and start else list(raw)
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
            agree = common_prefix_len(base.text, text)
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
