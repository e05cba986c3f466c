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

A first message changed in place (its content only: froggy's task plus test report) is re-rendered
from a window for a head-local template (``chat.head``), and the old piece it is encoded in is
re-tokenized only around the change (``chat.retokenize.resplice``, between line cuts, checked on the
old text; ``stats["window_fallbacks"]`` counts the pieces encoded in full after a failed check).
Token starts are kept as segments (``retokenize.Starts``), so no step costs per unchanged token.

Messages are compared with ``==`` (values equal in Python but rendered differently, such as ``1``
and ``1.0``, count as the same); remembered messages are copies, so mutating a message after
rendering it cannot make a stale render look current. Treat the returned ``Rendered`` as
read-only: it may be returned again for the same list.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from functools import cached_property
from typing import Any

from leyline_agent.chat.head import STAND_IN, content_only, head_local, splice_head
from leyline_agent.chat.locality import common_messages, full_text, splice_window
from leyline_agent.chat.render import Renderer
from leyline_agent.chat.render_state import RenderState, frozen
from leyline_agent.chat.retokenize import (
    Seg,
    Starts,
    encoding_starts,
    line_cuts,
    prefix_len,
    resplice,
)
from leyline_agent.chat.spans import (
    Message,
    Rendered,
    clamp_bounds,
    content_positions,
)

_MAX_PIECES = 4096  # remembered encoded pieces (about two messages each)
_MAX_PIECE_CHARS = 1 << 23  # and at most this many characters of them
_WINDOW_MIN = 2048  # a changed piece at least this long is re-tokenized around the change


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
        self._states: list[RenderState] = []
        self._local = local
        self._pieces: dict[str, tuple[list[int], Starts]] = {}
        self._piece_chars = 0
        self._last_head: tuple[list[Message], Any, bool, tuple[str, list[int]]] | None = None
        self.stats = {"windowed": 0, "window_fallbacks": 0}

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
        best, m, head = None, -1, False
        for s in self._states:
            if len(s.messages) <= m:  # NOTE: it cannot share more than the best so far
                continue
            if s.tools == tools_l and s.add_generation_prompt == add_generation_prompt:
                k, h = common_messages(s.messages, messages), False
                if k == 0 and self._head_changed(s.messages, messages):
                    # NOTE: only the first message's content changed before message ``k``.
                    k, h = 1 + common_messages(s.messages, messages, 1), True
                if k > m:
                    best, m, head = s, k, h
        if best is not None and m == len(messages) == len(best.messages) and not head:
            self._remember(best, best)
            return best.rendered
        found, need, pos, start = [], [], [0], 0
        if best is not None and head and m >= 3:  # (with m < 3 the list is rendered in full)
            w = [messages[0], *best.messages[1:3]]
            old_text, old_raw = splice_head(
                best.text, best.raw, *self._head_window(w, tools_l, add_generation_prompt)
            )
        elif best is not None:
            old_text, old_raw = best.text, best.raw
        if best is not None and head and m == len(messages) == len(best.messages):
            text, raw = old_text, old_raw
        elif best is not None and m >= 3 and self.local:
            window = [self._stand_in(messages[0]), messages[m - 2], *messages[m - 1 :]]
            text_w, raw_w = full_text(self.renderer, window, tools, add_generation_prompt)
            text, raw = splice_window(old_text, old_raw, m, text_w, raw_w)
            if not head:
                # Contents found wholly inside the unchanged text are found there again, and the
                # boundaries clamped by them stay (see ``Found.need``).
                start = min(bisect_right(best.need, best.raw[m - 1]), m - 1)
                found, need, pos = best.found[:start], best.need[:start], best.pos[: start + 1]
        else:
            text, raw = full_text(self.renderer, messages, tools, add_generation_prompt)
        tokens, starts, cuts, same, copied = self._encode(text, best)
        at = pos[-1]
        for f in content_positions(messages[start:], text, at):
            found.append(f)
            need.append(max(need[-1] if need else 0, f.need if f is not None else 0))
            at = f.end if f is not None and f.at >= 0 else at
            pos.append(at)
        bounds = [*best.bounds[:start], *raw[start:]] if best is not None and start else list(raw)
        clamp_bounds(bounds, found, len(text), start)
        # NOTE: a boundary kept from ``best`` inside the reused tokens starts best's span there
        k = bisect_right(bounds, same, 0, start) if best is not None and start else 0
        cut = [a for a, _ in best.rendered.spans[:k]] if best is not None else []
        cut += [starts.bisect_left(b) for b in bounds[len(cut) :]]
        rendered = Rendered(tokens, list(zip(cut, cut[1:], strict=False)), text)
        kept = best.messages[:m] if best is not None and m > 0 else []
        if head:
            kept[0] = frozen(messages[0])
        state = RenderState(
            [*kept, *map(frozen, messages[len(kept) :])],
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
            (best.tokens, copied) if best is not None and copied else None,
        )
        self._remember(best, state)
        return rendered

    def copied(self, rendered: Rendered, tokens: list[int]) -> list[tuple[int, int, int]]:
        """Runs ``(i, j, n)`` with ``rendered.tokens[j:j + n] == tokens[i:i + n]`` because the
        render copied them from ``tokens`` (the very list: compared by identity), for a
        remembered ``rendered`` (also by identity); ``[]`` when none is known. Lets a caller
        skip comparing those runs (``diff.diff_rendered``'s ``known``); the lists must not have
        been mutated (``Rendered`` is read-only)."""
        if rendered.tokens is tokens:
            return [(0, 0, len(tokens))]
        for s in self._states:
            if s.rendered is rendered:
                return list(s.copied[1]) if s.copied and s.copied[0] is tokens else []
        return []

    def _head_window(
        self, window: list[Message], tools: list[Any] | None, agp: bool
    ) -> tuple[str, list[int]]:
        """``full_text`` of a head window, remembered for the next one (a wrapper renders the
        incoming and the edited list: both start with the same three messages)."""
        last = self._last_head
        if last is not None and last[1] == tools and last[2] == agp:
            if common_messages(last[0], window) == len(window) == len(last[0]):
                return last[3]
        out = full_text(self.renderer, window, tools, agp)
        self._last_head = ([frozen(m) for m in window], tools, agp, out)
        return out

    def _stand_in(self, first: Message) -> Message:
        """The first message as a tail window renders it: for a head-local template the text
        after the window's second message does not depend on its content, so a long one is
        replaced by a short stand-in (its rendering is never used)."""
        content = first.get("content")
        if isinstance(content, str) and len(content) > _WINDOW_MIN and head_local(self.renderer):
            return {**first, "content": STAND_IN}
        return first

    def _head_changed(self, old: list[Message], new: list[Message]) -> bool:
        """Only the first message's content differs at the front, and ``splice_head`` applies."""
        return (
            len(old) >= 3
            and len(new) >= 3
            and content_only(old[0], new[0])
            and self.local
            and head_local(self.renderer)
        )

    def _encode(
        self, text: str, base: RenderState | None
    ) -> tuple[list[int], Starts, list, int, list[tuple[int, int, int]]]:
        """Token ids, token starts and cut points of ``text``, the characters at its start whose
        tokens are ``base``'s (the same ids and starts), and the runs of ``base.tokens`` copied
        (``(index there, index in the ids, count)``): ``base``'s ids up to the last cut
        inside the text both agree on, then piece by piece (a piece ends after a special token),
        each piece's ids remembered. A long first piece is re-tokenized from ``base``'s around the
        change (``resplice``), and where the texts agree again after it (a first message changed
        in place), ``base``'s ids are reused up to the last cut inside that agreement."""
        cut_ids, splitter = self._cuts
        i = p = j = 0
        tokens: list[int] = []
        segs: list[Seg] = []
        cuts: list[int] = []
        copied: list[tuple[int, int, int]] = []
        if base is not None and cut_ids:
            j = self._reusable(base, 0, 0, prefix_len(base.text, text))
            if j:
                i = base.cuts[j - 1]
                p = base.starts[i] if i < len(base.starts) else len(base.text)
                tokens, cuts = base.tokens[:i], base.cuts[:j]
                segs = list(base.starts.slice(0, i).segs)
                _run(copied, 0, 0, i)
        same, first = p, True
        while True:
            m = splitter.search(text, p) if splitter else None
            end = m.end() if m is not None else len(text)
            piece = text[p:end]
            hit = self._pieces.get(piece)
            if hit is None:
                if first and base is not None and len(piece) >= _WINDOW_MIN:
                    kept: list[tuple[int, int, int]] = []
                    hit = self._resplice(base, i, j, p, piece, kept)
                    for o, k, n in kept if hit is not None else ():
                        _run(copied, o, len(tokens) + k, n)
                if hit is None:
                    enc = self._encoder(piece)
                    hit = (enc.ids, Starts.of(encoding_starts(enc)))
                if len(self._pieces) > _MAX_PIECES or self._piece_chars > _MAX_PIECE_CHARS:
                    self._pieces.clear()
                    self._piece_chars = 0
                self._pieces[piece] = hit
                self._piece_chars += len(piece)
            ids, local = hit
            if ids and ids[-1] in cut_ids:
                cuts.append(len(tokens) + len(ids))
            tokens += ids
            segs += [(sh + p, loc, lo, hi) for sh, loc, lo, hi in local.segs]
            if first and base is not None and cut_ids and j < len(base.cuts) and end < len(text):
                # NOTE: base's piece at p ended at its cut ``c``; where the texts agree from
                # there on, its ids up to the last cut inside the agreement are the new ones.
                c = base.cuts[j]
                q = base.starts[c] if c < len(base.starts) else len(base.text)
                j2 = self._reusable(base, q, j + 1, prefix_len(base.text[q:], text[end:]))
                if j2 > j + 1:
                    c2, off, shift = base.cuts[j2 - 1], len(tokens) - c, end - q
                    _run(copied, c, len(tokens), c2 - c)
                    tokens += base.tokens[c:c2]
                    segs += base.starts.slice(c, c2, shift).segs
                    cuts += [x + off for x in base.cuts[j + 1 : j2]]
                    end = (base.starts[c2] if c2 < len(base.starts) else len(base.text)) + shift
            first = False
            p = end
            if p >= len(text):
                return tokens, Starts(segs), cuts, same, copied

    @staticmethod
    def _reusable(base: RenderState, at: int, lo: int, agree: int) -> int:
        """How many of ``base.cuts`` (from index ``lo``) lie inside ``base.text[at:at + agree]``,
        the stretch the new text agrees with, plus ``lo``."""
        # NOTE: token i - 1 ends where token i starts; a cut at i is reusable when that end
        # lies inside the agreement (the whole old text counts as ending at its length).
        end = at + agree
        q = len(base.starts) + 1 if end == len(base.text) else base.starts.bisect_right(end)
        return max(bisect_left(base.cuts, q, lo), lo)

    def _encoder(self, text: str) -> Any:
        return self.renderer.tokenizer.encode(text, add_special_tokens=False)

    def _resplice(
        self, base: RenderState, i: int, j: int, p: int, piece: str, kept: list
    ) -> tuple[list[int], Starts] | None:
        """``piece`` (at ``p``) re-tokenized from ``base``'s piece at ``p`` (its tokens from ``i``
        to the next cut after ``base.cuts[j - 1]``), or None (encode it in full)."""
        if not line_cuts(self.renderer.tokenizer):
            return None
        c = base.cuts[j] if j < len(base.cuts) else len(base.tokens)
        q = base.starts[c] if c < len(base.starts) else len(base.text)
        old = base.text[p:q]
        if len(old) < _WINDOW_MIN // 2:
            return None
        old_starts = base.starts.slice(i, c, -p)
        return resplice(
            self._encoder, old, base.tokens, old_starts, piece, self.stats, at=i, kept=kept
        )

    def _remember(self, used: RenderState | None, state: RenderState) -> None:
        """Most recent first: the new state, then the one it was made from, then the rest."""
        rest = [s for s in self._states if s is not used and s is not state]
        self._states = [state, *([used] if used is not None and used is not state else []), *rest]
        del self._states[self.max_states :]


def _run(runs: list[tuple[int, int, int]], old: int, new: int, n: int) -> None:
    """Append the copied run ``(old, new, n)``, joined to the last one where it continues it."""
    if n <= 0:
        return
    if runs and runs[-1][0] + runs[-1][2] == old and runs[-1][1] + runs[-1][2] == new:
        o, k, m = runs.pop()
        old, new, n = o, k, m + n
    runs.append((old, new, n))
