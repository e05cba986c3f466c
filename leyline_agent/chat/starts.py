"""Token starts as segments (``Starts``): every token's first character in a text, held as runs
of remembered encodings' offsets, so that keeping, moving and joining runs of tokens costs one step
per segment rather than per token (``retokenize.resplice``, ``render_cache``)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from itertools import islice

from tokenizers import Encoding

Seg = tuple[int, list[int], int, int]  # (shift, local starts, lo, hi): local[lo:hi] + shift

_SMALL, _SMALL_RUN = 2048, 16  # runs of this many segments of fewer tokens are flattened
_MAX_SEGS = 512  # beyond it every segment is (a long session: once in a few hundred turns)


def _compacted(segs: list[Seg]) -> list[Seg]:
    """``segs`` with every run of at least ``_SMALL_RUN`` small segments flattened into one (each
    token is flattened at most once, so slicing and joining stay cheap as pieces accumulate)."""
    out: list[Seg] = []
    run: list[Seg] = []
    for seg in [*segs, (0, [], 0, _SMALL)]:  # the sentinel ends the last run
        if seg[3] - seg[2] < _SMALL:
            run.append(seg)
            continue
        if len(run) >= _SMALL_RUN:
            flat = [shift + v for shift, local, lo, hi in run for v in local[lo:hi]]
            out.append((0, flat, 0, len(flat)))
        else:
            out += run
        run = []
        out.append(seg)
    out.pop()  # the sentinel
    return out


class Starts:
    """First character of every token, as segments (``Seg``); immutable.

    Supports ``len``, integer indexing, ``bisect_left``/``bisect_right`` (first token whose start
    is ``>=``/``>`` a character), ``slice(i, j, shift)`` and ``+``, each in O(segments).
    Segments must be increasing: every start of one is below the first start of the next.
    """

    __slots__ = ("segs", "_tok", "_first", "_len")

    def __init__(self, segs: Sequence[Seg] = ()) -> None:
        merged: list[Seg] = []
        for seg in segs:
            if seg[3] <= seg[2]:
                continue
            if merged:
                shift, local, lo, hi = merged[-1]
                if seg[1] is local and seg[0] == shift and seg[2] == hi:
                    merged[-1] = (shift, local, lo, seg[3])
                    continue
            merged.append(seg)
        if len(merged) > _SMALL_RUN:
            merged = _compacted(merged)
        if len(merged) > _MAX_SEGS:  # a long session's windows between big runs: flatten once
            flat = [shift + v for shift, local, lo, hi in merged for v in local[lo:hi]]
            merged = [(0, flat, 0, len(flat))]
        self.segs = merged
        tok, first, n = [], [], 0
        for shift, local, lo, hi in merged:
            tok.append(n)
            first.append(shift + local[lo])
            n += hi - lo
        self._tok, self._first, self._len = tok, first, n

    @classmethod
    def of(cls, local: list[int], shift: int = 0) -> Starts:
        """The starts ``local`` (sorted; kept, not copied: do not mutate it) moved by ``shift``."""
        return cls([(shift, local, 0, len(local))])

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, k: int) -> int:
        if k < 0:
            k += self._len
        if not 0 <= k < self._len:
            raise IndexError(k)
        s = bisect_right(self._tok, k) - 1
        shift, local, lo, _ = self.segs[s]
        return shift + local[lo + k - self._tok[s]]

    def __iter__(self) -> Iterator[int]:
        for shift, local, lo, hi in self.segs:
            for v in islice(local, lo, hi):
                yield shift + v

    def tolist(self) -> list[int]:
        return list(self)

    def bisect_left(self, x: int) -> int:
        """Index of the first token starting at or after character ``x``."""
        s = bisect_left(self._first, x) - 1
        if s < 0:
            return 0
        shift, local, lo, hi = self.segs[s]
        return self._tok[s] + bisect_left(local, x - shift, lo, hi) - lo

    def bisect_right(self, x: int) -> int:
        """Index of the first token starting after character ``x``."""
        s = bisect_right(self._first, x) - 1
        if s < 0:
            return 0
        shift, local, lo, hi = self.segs[s]
        return self._tok[s] + bisect_right(local, x - shift, lo, hi) - lo

    def slice(self, i: int, j: int, shift: int = 0) -> Starts:
        """Tokens ``[i, j)``, moved by ``shift`` characters."""
        i, j = max(i, 0), min(j, self._len)
        out: list[Seg] = []
        if i < j:
            s = bisect_right(self._tok, i) - 1
            while s < len(self.segs) and self._tok[s] < j:
                sh, local, lo, hi = self.segs[s]
                t0 = self._tok[s]
                out.append((sh + shift, local, lo + max(0, i - t0), lo + min(hi - lo, j - t0)))
                s += 1
        return Starts(out)

    def shifted(self, shift: int) -> Starts:
        return Starts([(sh + shift, local, lo, hi) for sh, local, lo, hi in self.segs])

    def __add__(self, other: Starts) -> Starts:
        return Starts([*self.segs, *other.segs])


def encoding_starts(enc: Encoding) -> list[int]:
    return [s for s, _ in enc.offsets]
