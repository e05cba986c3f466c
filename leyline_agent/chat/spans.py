"""Message spans in a rendered prompt, and the ``Rendered`` type every planner reads.

Message ``k`` owns the characters from where the rendering of ``messages[:k]`` stops agreeing with
the full rendering to where that of ``messages[:k+1]`` does (where the shorter rendering diverges,
no later than where a probe message in ``k``'s place does; and never inside a message's content,
as found in order in the full text), and the tokens whose first character falls there. Spans tile
the prompt: the tokens before ``spans[0]`` are the template's preamble, those after ``spans[-1]``
the generation prompt. A token that straddles a boundary belongs to the message it starts in. The
spans are a best effort for templates that render a message differently depending on what
follows; nothing downstream relies on them for correctness.

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


def token_spans(starts: Sequence[int], bounds: Sequence[int]) -> list[tuple[int, int]]:
    """Token span of every message: the tokens whose first character (``starts``, sorted) falls
    between consecutive character ``bounds``."""
    at = [bisect_left(starts, b) for b in bounds]
    return [(at[k], at[k + 1]) for k in range(len(bounds) - 1)]
