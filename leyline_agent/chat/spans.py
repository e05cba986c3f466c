"""Message spans in a rendered prompt, and the ``Rendered`` type every planner reads.

Message ``k`` owns the characters from where the rendering of ``messages[:k]`` stops agreeing with
the full rendering to where that of ``messages[:k+1]`` does (where the shorter rendering diverges,
no later than where a probe message in ``k``'s place does; and never inside a message's content,
as found in order in the full text), and the tokens whose first character falls there. Spans tile
the prompt: the tokens before ``spans[0]`` are the template's preamble, those after ``spans[-1]``
the generation prompt. A token that straddles a boundary belongs to the message it starts in.

Templates that render earlier messages differently depending on what follows (reasoning models:
Qwen3 renders ``<think>`` blocks only after the last user query, GLM-4.5 and Kimi-K2-thinking empty
them before it) make a prefix rendering stop agreeing with the full one early, inside an earlier
message. Then, where the rendering of ``messages[:k]`` extends that of ``messages[:k-1]`` whose
end is known in the full text, the end of the added piece is found there again (``resync``). The
spans are a best effort; nothing downstream relies on them for correctness (the diff is exact by
construction).

This module holds the type and the pieces that do not render (finding contents, clamping,
characters to tokens); ``chat.render.Renderer.raw_bounds`` renders the prefixes.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from sys import maxsize
from typing import Any, NamedTuple

from leyline_agent.messages import message_text

Message = Mapping[str, Any]


class Rendered(NamedTuple):
    """A rendered prompt.

    tokens: the prompt's token ids.
    spans: ``(start, end)`` token span of every message, in order; contiguous
        (``spans[k][1] == spans[k + 1][0]``).
    text: the prompt string the tokens encode.
    """

    tokens: list[int]
    spans: list[tuple[int, int]]
    text: str = ""


def common_prefix_len(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))  # invariant: a[:lo] == b[:lo], a[:hi+1] != b[:hi+1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Found(NamedTuple):
    """Where a message's content was found in the prompt text (``at < 0``: not found).

    need: the text must agree up to here for a search from the same position to find the same
        (``end`` for a verbatim match; past any text for a stripped match or none).
    """

    at: int
    end: int
    need: int


def content_positions(messages: Sequence[Message], text: str, pos: int = 0) -> list[Found | None]:
    """Each message's content found in ``text`` in order from ``pos`` (stripped where the verbatim
    content is absent); None for an empty content."""
    found: list[Found | None] = []
    for m in messages:
        c = message_text(m)
        if not c:
            found.append(None)
            continue
        at = text.find(c, pos)
        if at >= 0:
            found.append(Found(at, at + len(c), at + len(c)))
        else:
            c = c.strip()
            at = text.find(c, pos) if c else -1
            found.append(Found(at, at + len(c), maxsize) if at >= 0 else Found(-1, -1, maxsize))
        if at >= 0:
            pos = at + len(c)
    return found


def clamp_bounds(
    bounds: list[int], found: Sequence[Found | None], text_len: int, start: int = 0
) -> None:
    """``clamp_to_contents`` on precomputed ``content_positions``, from boundary ``start`` on."""
    for k in range(start, len(bounds)):
        prev = found[k - 1] if k else None
        lo = prev.end if prev is not None and prev.at >= 0 else 0
        cur = found[k] if k < len(found) else None
        hi = cur.at if cur is not None and cur.at >= 0 else text_len
        if k:
            lo = max(lo, bounds[k - 1])
        bounds[k] = min(max(bounds[k], lo), max(hi, lo))


def clamp_to_contents(bounds: list[int], messages: Sequence[Message], text: str) -> None:
    """Keep each boundary between the previous message's content and the next one's.

    Where a template renders a message differently depending on what follows, the prefix
    renderings disagree with the full one early and the boundaries collapse; the contents,
    found in order in the full text, bound them (contents the template altered are skipped).
    """
    clamp_bounds(bounds, content_positions(messages, text), len(text))


def common_suffix_len(a: str, a_end: int, b: str, b_end: int) -> int:
    """Length of the longest common suffix of ``a[:a_end]`` and ``b[:b_end]``."""
    lo, hi = 0, min(a_end, b_end)  # invariant: the last lo characters agree
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[a_end - mid : a_end] == b[b_end - mid : b_end]:
            lo = mid
        else:
            hi = mid - 1
    return lo


_KEY = 16  # characters of a piece's end looked up in the full text
_SHORT_KEY = 4  # then these (what survives of the piece after a dropped block may be short)
_CANDIDATES = 256  # positions checked per look-up
_TRIMS = 3  # closing segments (``<...>`` or a line) a rendering may end with
_SLACK = 0  # characters the full text may have where the rendering had more (none: deletions)


def resync(piece: str, text: str, start: int, hi: int) -> tuple[int, int] | None:
    """Where ``piece``, a message rendered as the last one, ends in ``text`` (which has that
    message's rendering from ``start`` on, ending by ``hi``).

    The full text may lack a middle part of the piece (a think block the template drops or
    empties once later messages follow): the end is a position ``q`` with ``text[start:q]`` no
    longer than the piece and made of the piece's common prefix and suffix with it; of several,
    the one with the longest common suffix, then the first. Where there is none, the piece's
    last segments (a closing rendered only after the last message, such as ``<|im_end|>``; up to
    three) are dropped and the rest is looked up. Returns the end in ``text`` and the length of
    the piece it ends (None: not found).
    """
    end = len(piece)
    if text.startswith(piece, start):
        return start + end, end
    for _ in range(_TRIMS + 1):
        if end <= 0:
            return None
        limit = min(hi, start + end + _SLACK)  # the segment is no longer than the piece
        head = common_prefix_len(piece[:end], text[start:limit])
        for m in dict.fromkeys((min(end, _KEY), min(end, _SHORT_KEY))):
            q = _best_end(piece, end, text, start, limit, head, m)
            if q is not None:
                return q, end
        end = max(piece.rfind("\n", 0, end - 1) + 1, piece.rfind("<", 0, end - 1))
    return None


def _best_end(
    piece: str, end: int, text: str, start: int, limit: int, head: int, m: int
) -> int | None:
    """``resync``'s look-up of ``piece[:end]``'s last ``m`` characters (see there)."""
    key = piece[end - m : end]
    best, best_suffix = None, -1
    i = text.find(key, start, limit)
    for _ in range(_CANDIDATES):
        if i < 0:
            break
        q = i + m
        c2 = min(common_suffix_len(piece, end, text, q), end)
        if q - start <= min(min(head, q - start) + c2, end) + _SLACK and c2 > best_suffix:
            best, best_suffix = q, c2
        i = text.find(key, i + 1, limit)
    return best


def token_spans(starts: Sequence[int], bounds: Sequence[int]) -> list[tuple[int, int]]:
    """Token span of every message: the tokens whose first character (``starts``, sorted) falls
    between consecutive character ``bounds``."""
    at = [bisect_left(starts, b) for b in bounds]
    return [(at[k], at[k + 1]) for k in range(len(bounds) - 1)]
