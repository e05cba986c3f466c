"""Re-tokenizing an edited text at a cost that follows the edit: line cuts and segmented starts.

Line cuts. A tokenizer encodes a text as: added tokens split out, then the pre-tokenizer's pieces
(a regex split for byte-level BPE), each piece encoded on its own. For the regex splitters of
GPT-2, cl100k, o200k, Llama 3 and Qwen 2 no piece holds a newline followed by an ASCII letter or
digit (a piece ends after its newlines), so the text around such a *line cut* is encoded
independently: ``encode(t) == encode(t[:x]) + encode(t[x:])`` whenever ``t[x - 1] == "\\n"`` and
``t[x]`` is ``[A-Za-z0-9]``. ``line_cuts(tokenizer)`` decides once per tokenizer whether that holds
(a screen of its normalizer, pre-tokenizer and added tokens, then a probe on mixed text); a
tokenizer that fails it (SentencePiece's Metaspace, a prefix space, a newline in an added token)
gets none.

``resplice`` turns the tokens of an old text into those of a new one that differs from it in one
place: it keeps the old tokens up to the last line cut before the first differing character and
from the first line cut inside the common suffix on, and encodes only the window between them.
Before using the window it checks that the old text's same window, encoded on its own, gives
exactly the old tokens there (cheap: the window's size); if not, or if no window saves work, it
returns None and the caller encodes in full.

Token starts are kept as segments (``chat/starts.py``: ``Starts``), so that keeping, moving and
joining runs of tokens costs one step per segment rather than per token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from tokenizers import Encoding, Tokenizer

from leyline_agent.chat.starts import Seg, Starts, encoding_starts

__all__ = ["Seg", "Starts", "encoding_starts", "line_cuts", "prefix_len", "resplice", "suffix_len"]


def prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix (O(n) copying: doubling, then halving, chunks)."""
    n = min(len(a), len(b))
    lo, step = 0, 256
    while lo < n:
        hi = min(n, lo + step)
        if a[lo:hi] != b[lo:hi]:
            while hi - lo > 1:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
                mid = (lo + hi) // 2
                if a[lo:mid] == b[lo:mid]:
                    lo = mid
                else:
                    hi = mid
            return lo
        lo, step = hi, step * 2
    return n


def suffix_len(a: str, b: str, cap: int) -> int:
    """Length of the longest common suffix, at most ``cap``."""
    la, lb = len(a), len(b)
    lo, step = 0, 256
    while lo < cap:
        hi = min(cap, lo + step)
        if a[la - hi : la - lo] != b[lb - hi : lb - lo]:
            while hi - lo > 1:  # common suffix is >= lo and < hi
                mid = (lo + hi) // 2
                if a[la - mid : la - lo] == b[lb - mid : lb - lo]:
                    lo = mid
                else:
                    hi = mid
            return lo
        lo, step = hi, step * 2
    return cap


_LINE = re.compile(r"\n[A-Za-z0-9]")


def _cut_before(text: str, end: int) -> int:
    """The last line cut ``x`` with ``x < end`` (``text[x]`` before ``end``), or 0."""
    span = 1024
    while True:
        lo = max(0, end - span)
        last = None
        for last in _LINE.finditer(text, lo, end):  # noqa: B007 - the last match is wanted
            pass
        if last is not None:
            return last.start() + 1
        if lo == 0:
            return 0
        span *= 16


def _cut_after(text: str, start: int) -> int:
    """The first line cut ``x`` with ``x - 1 >= start``, or ``len(text)``."""
    m = _LINE.search(text, start)
    return m.start() + 1 if m is not None else len(text)


def resplice(
    encode: Callable[[str], Encoding],
    old: str,
    old_ids: list[int],
    old_starts: Starts,
    new: str,
    stats: dict[str, int] | None = None,
    at: int = 0,
    kept: list[tuple[int, int, int]] | None = None,
) -> tuple[list[int], Starts] | None:
    """Token ids and starts of ``new`` from ``old``'s (see module docstring), or None.

    ``old_ids[at:at + len(old_starts)]``/``old_starts`` must be ``old``'s exact encoding (``at``:
    where it lies in a longer list, not copied), and both texts must be encoded on their own
    (they start and end at cuts the caller knows, such as special tokens). ``stats``:
    ``"windowed"`` counts the windows used, ``"window_fallbacks"`` the failed checks. ``kept``:
    where given, ``(old index, new index, count)`` of each run of ``old_ids`` copied into the
    result is appended (old index in ``old_ids``, new index in the result).
    """
    stats = stats if stats is not None else {}
    agree = prefix_len(old, new)
    if agree == len(old) == len(new):
        if kept is not None:
            kept.append((at, 0, len(old_starts)))
        return old_ids[at : at + len(old_starts)], old_starts
    delta = len(new) - len(old)
    common = suffix_len(old, new, min(len(old), len(new)) - agree)
    a = _cut_before(new, agree)
    x = _cut_after(new, len(new) - common)
    if 2 * (x - a) > len(new):
        return None  # the window would be most of the text: no saving
    x0 = x - delta
    i, j = old_starts.bisect_left(a), old_starts.bisect_left(x0)
    was = encode(old[a:x0])
    if (
        (i < len(old_starts) and old_starts[i] != a)
        or (j < len(old_starts) and old_starts[j] != x0)
        or was.ids != old_ids[at + i : at + j]
        or [a + s for s in encoding_starts(was)] != old_starts.slice(i, j).tolist()
    ):
        stats["window_fallbacks"] = stats.get("window_fallbacks", 0) + 1
        return None
    stats["windowed"] = stats.get("windowed", 0) + 1
    enc = encode(new[a:x])
    ids = old_ids[at : at + i]
    ids += enc.ids
    ids += old_ids[at + j : at + len(old_starts)]
    if kept is not None:
        kept += [(at, 0, i), (at + j, i + len(enc.ids), len(old_starts) - j)]
    starts = (
        old_starts.slice(0, i)
        + Starts.of(encoding_starts(enc), a)
        + old_starts.slice(j, len(old_starts), delta)
    )
    return ids, starts


_PROBE = (
    "Task: fix the tests.\nDate: Tue Dec  1 22:18:20 2026\n\n1 passed, 2 failed in 0.3s\n"
    "def f(x):\n    return x**2  # comment\r\nclass A:\n\tpass\n\n\nEOF\n"
    "  indented\nline 3\n9 items\n...\n/usr/lib\n//x\n(a)\nb)\n'quoted'\nit's\n"
    "数学 über naïve café 😀👍🏽 ١٢٣ Ⅻ\n😀x\nÅngström\nx\u0301y\n\u00a0nbsp\nA\n0\nz"
    "\n\n \nX\n\t\nY \n Z\nDONE.\n123456\n7\n"
)
_SAFE: dict[int, tuple[Tokenizer, bool]] = {}


def line_cuts(tokenizer: Tokenizer) -> bool:
    """Whether line cuts are safe for ``tokenizer`` (see module docstring; decided once)."""
    hit = _SAFE.get(id(tokenizer))
    if hit is None or hit[0] is not tokenizer:
        try:
            safe = _line_cuts(tokenizer)
        except Exception:  # noqa: BLE001 - a tokenizer the screen cannot read gets no line cuts
            safe = False
        hit = _SAFE[id(tokenizer)] = (tokenizer, safe)
    return hit[1]


def _state(component: object) -> dict:
    getstate = getattr(component, "__getstate__", None)
    raw = getstate() if getstate is not None else None
    return json.loads(raw) if isinstance(raw, bytes | str) else {}


def _types(state: object) -> list[dict]:
    """Every component state in a (possibly nested) ``Sequence``."""
    if isinstance(state, dict):
        inner = state.get("pretokenizers") or state.get("normalizers")
        if state.get("type") == "Sequence" and isinstance(inner, list):
            return [t for s in inner for t in _types(s)]
        return [state]
    return []


def _line_cuts(tokenizer: Tokenizer) -> bool:
    for a in tokenizer.get_added_tokens_decoder().values():
        if a.lstrip or a.rstrip or a.single_word or "\n" in a.content:
            return False
    if tokenizer.normalizer is not None:
        if any(t.get("type") != "NFC" for t in _types(_state(tokenizer.normalizer))):
            return False
    if tokenizer.pre_tokenizer is None:
        return False
    for t in _types(_state(tokenizer.pre_tokenizer)):
        if t.get("type") not in ("Split", "ByteLevel", "Digits"):
            return False
        if t.get("type") == "ByteLevel" and t.get("add_prefix_space"):
            return False
    text = _PROBE
    full = tokenizer.encode(text, add_special_tokens=False)
    pieces = tokenizer.pre_tokenizer.pre_tokenize_str(text)
    bounds = {s for _, (s, _) in pieces}
    for m in _LINE.finditer(text):
        x = m.start() + 1
        if x not in bounds:
            return False
        left = tokenizer.encode(text[:x], add_special_tokens=False)
        right = tokenizer.encode(text[x:], add_special_tokens=False)
        if left.ids + right.ids != full.ids:
            return False
        if encoding_starts(left) + [x + s for s in encoding_starts(right)] != encoding_starts(full):
            return False
    return True
