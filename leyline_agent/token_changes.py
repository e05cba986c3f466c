"""Token-level changes between two token lists (``diff.py``'s regions): the common prefix and
suffix by slices, then ``difflib`` on what differs, so that several small edits (a template
dropping think blocks from several messages) stay several small directives.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import NamedTuple

from leyline_agent.directive import Directive, Mode


class Region(NamedTuple):
    old_start: int
    old_end: int
    new_start: int
    new_end: int
    mode: Mode | None  # None: unchanged tokens


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if type(a) is not type(b):
        a, b = list(a[:n]), list(b[:n])
    return _prefix(a, 0, b, 0, n)


def _prefix(a: Sequence[int], i: int, b: Sequence[int], j: int, n: int) -> int:
    """Common prefix of ``a[i:i + n]`` and ``b[j:j + n]`` (at most ``n``), compared by chunks."""
    # NOTE: compared by slices (C speed), doubling then halving: O(n) copying in all, and no
    # copy of the whole ranges.
    lo, step = 0, 64
    while lo < n:
        hi = min(n, lo + step)
        if a[i + lo : i + hi] != b[j + lo : j + hi]:
            while hi - lo > 1:  # a[i:i+lo] == b[j:j+lo], a[i:i+hi] != b[j:j+hi]
                mid = (lo + hi) // 2
                same = a[i + lo : i + mid] == b[j + lo : j + mid]
                lo, hi = (mid, hi) if same else (lo, mid)
            return lo
        lo, step = hi, step * 2
    return n


def _suffix(a: Sequence[int], ea: int, b: Sequence[int], eb: int, n: int) -> int:
    """Common suffix of ``a[:ea]`` and ``b[:eb]``, at most ``n``."""
    lo, step = 0, 64  # the last lo agree, as in _prefix
    while lo < n:
        hi = min(n, lo + step)
        if a[ea - hi : ea - lo] != b[eb - hi : eb - lo]:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                same = a[ea - mid : ea - lo] == b[eb - mid : eb - lo]
                lo, hi = (mid, hi) if same else (lo, mid)
            return lo
        lo, step = hi, step * 2
    return n


MIN_KEEP = 4  # equal tokens between two changes kept apart (fewer: one directive covers both)
MAX_CELLS = 1 << 20  # old x new tokens of a changed run matched token by token (more: trimmed only)


def token_changes(
    old: list[int],
    new: list[int],
    whole: bool = True,
    at: tuple[int, int, int, int] | None = None,
) -> list[tuple[int, int, int, int]] | None:
    """``(old_start, old_end, new_start, new_end)`` of what differs between ``old`` and ``new``
    (``at``: between ``old[at[0]:at[1]]`` and ``new[at[2]:at[3]]``, positions in the whole lists):
    the common prefix and suffix trimmed, then, for a run small enough, difflib's opcodes on the
    token ids (autojunk off), changes fewer than ``MIN_KEEP`` equal tokens apart joined. A run
    too big to match: one change (None unless ``whole``)."""
    a0, b0, c0, d0 = at if at is not None else (0, len(old), 0, len(new))
    n = min(b0 - a0, d0 - c0)
    k = _prefix(old, a0, new, c0, n)
    k2 = _suffix(old, b0, new, d0, n - k)
    a, b, c, d = a0 + k, b0 - k2, c0 + k, d0 - k2
    if a == b and c == d:
        return []
    if a == b or c == d:
        return [(a, b, c, d)]
    if (b - a) * (d - c) > MAX_CELLS:
        return [(a, b, c, d)] if whole else None
    out: list[tuple[int, int, int, int]] = []
    ops = difflib.SequenceMatcher(None, old[a:b], new[c:d], autojunk=False).get_opcodes()
    for tag, i1, i2, j1, j2 in ops:
        if tag == "equal":
            continue
        if out and a + i1 - out[-1][1] < MIN_KEEP:
            out[-1] = (out[-1][0], a + i2, out[-1][2], c + j2)
        else:
            out.append((a + i1, a + i2, c + j1, c + j2))
    return out


def region_directives(old: list[int], new: list[int], regions: list[Region]) -> list[Directive]:
    """The directives of each run of consecutive changed regions: the tokens that differ
    (``token_changes``), so that changes to several messages (a template dropping think blocks from
    every earlier turn) stay apart however the spans fell (a run too big to match as one: region
    by region); directives that touch merge. A directive's mode is the strongest of the changed
    regions it touches."""
    out: list[Directive] = []
    i = 0
    while i < len(regions):
        if regions[i].mode is None:
            i += 1
            continue
        j = i
        while j < len(regions) and regions[j].mode is not None:
            j += 1
        run = regions[i:j]
        bounds = (run[0].old_start, run[-1].old_end, run[0].new_start, run[-1].new_end)
        found = token_changes(old, new, whole=False, at=bounds)
        if found is None:  # too big to match as one run: region by region
            found = [
                f
                for r in run
                for f in token_changes(
                    old, new, at=(r.old_start, r.old_end, r.new_start, r.new_end)
                )
                or []
            ]
        for s, e, s2, e2 in found:
            mode = strongest_mode(
                [
                    r.mode
                    for r in run
                    if (r.old_start < e and s < r.old_end)
                    or (r.new_start < e2 and s2 < r.new_end)
                    or (r.old_start <= s <= r.old_end and r.new_start <= s2 <= r.new_end)
                ]
            )
            repl = tuple(new[s2:e2])
            if out and out[-1].end == s:  # touching (or two insertions at one point): merge
                prev = out.pop()
                s, repl, mode = prev.start, prev.replacement + repl, Mode.strongest(prev.mode, mode)
            out.append(Directive(start=s, end=e, replacement=repl, mode=mode or Mode.AMORTIZE))
        i = j
    return out


def strongest_mode(modes: Sequence[Mode | None]) -> Mode | None:
    """The strongest of ``modes`` (``Mode.strongest``; None: all unchanged)."""
    out: Mode | None = None
    for mode in modes:
        out = Mode.strongest(out, mode)
    return out
