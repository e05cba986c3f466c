"""Turn planning's pure half: the directives that turn the previous prompt into this one.

Given the previous turn's messages and prompt (what the server holds) and this turn's rendered
messages, the result is a set of directives on the old tokens plus a tail of new tokens, with
``apply_directives(old, directives) + tail == tokens`` exactly. ``wrapper.ConversationWrapper``
runs the policy, renders and calls this.

Diff rule (``diff_rendered``):

1. Align old and new messages (difflib on the messages themselves). Messages appended at the end
   are the tail's; the old generation prompt (``<|im_start|>assistant\\n``) is kept as far as it
   agrees with the start of what follows it now.
2. Aligned messages map old token ranges (their spans) to new ones, message by message where
   the counts allow. An unchanged message whose tokens nonetheless differ (a template that
   re-renders earlier messages differently) counts as changed and sets ``fallback``; so does a
   changed preamble (unless the tools changed).
3. Each run of consecutive changed ranges is trimmed by its longest common token prefix and
   suffix and, where it is small enough, matched token by token (difflib on the ids): every
   part that differs becomes one directive that touches only the differing tokens (parts fewer
   than ``MIN_KEEP`` equal tokens apart join), so that a template's small edits to several
   earlier messages (think blocks dropped once a new user query follows) stay small directives
   however the spans fell. A directive's mode is the strongest mode of the policy edits behind
   the ranges it touches (``old_modes``/``new_modes``); a change no edit made (the agent rewrote
   a message, the template re-rendered one) gets ``default_mode``.
4. The result is verified; if it ever failed, one directive from the first differing token
   replaces the rest (``fallback``), which is exact by construction.

Runs of tokens the caller knows equal (``known``: the incremental renderer copied them from the
old prompt, ``IncrementalRenderer.copied``) are not compared again: the checks of steps 2-4 then
cost what changed, not the prompt (a 60k-token slice and compare is a millisecond here).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

from leyline_agent.chat.spans import Rendered
from leyline_agent.directive import Directive, Mode, sort_and_check
from leyline_agent.token_changes import (
    Region,
    common_prefix,
    region_directives,
    strongest_mode,
)

Opcode = tuple[Literal["replace", "delete", "insert", "equal"], int, int, int, int]


class Diff(NamedTuple):
    """Directives on the old tokens plus the appended tail.

    fallback: some tokens differed where the messages did not (template instability or changed
        tools), or the span alignment failed and one covering directive was used.
    """

    directives: list[Directive]
    tail: list[int]
    fallback: bool


def diff_tokens(old: Sequence[int], new: Sequence[int], mode: Mode = Mode.AMORTIZE) -> Diff:
    """Token-only diff: keep the common prefix, one directive drops the rest of ``old``.

    For callers without message spans. ``fallback`` is set when ``old`` is not a prefix of
    ``new``.
    """
    p = common_prefix(old, new)
    if p == len(old):
        return Diff([], list(new[p:]), False)
    return Diff([Directive(start=p, end=len(old), mode=mode)], list(new[p:]), True)


_KEY_ENCODER = json.JSONEncoder(sort_keys=True, default=str)


def message_key(message: Mapping[str, Any]) -> Hashable:
    """What message alignment compares: a message whose values are all strings as its sorted
    ``(key, value)`` pairs (no copy of a long content), any other as ``json.dumps(message,
    sort_keys=True, default=str)``. A key of one kind never equals one of the other."""
    if all(type(v) is str for v in message.values()):
        return tuple(sorted(message.items()))
    return _KEY_ENCODER.encode(message)


Known = Sequence[tuple[int, int, int]]  # (old index, new index, count) of equal runs


def _same(old: list[int], a: int, b: int, new: list[int], c: int, known: Known) -> bool:
    """``old[a:b] == new[c:c + b - a]`` (``c + b - a <= len(new)``), comparing only what no
    ``known`` run at the same offset holds."""
    while a < b:
        k = min(b - a, _known_prefix(known, a, c))
        if k:
            a, c = a + k, c + k
            continue
        nxt = min([o for o, j, n in known if a < o < b and o - a == j - c], default=b)
        if old[a:nxt] != new[c : c + nxt - a]:
            return False
        a, c = nxt, c + nxt - a
    return True


def _known_prefix(known: Known, a: int, c: int) -> int:
    """How many tokens from ``old[a]``/``new[c]`` on are known equal."""
    return max([o + n - a for o, k, n in known if o <= a < o + n and a - o == c - k], default=0)


def _known_suffix(known: Known, b: int, d: int) -> int:
    """How many tokens before ``old[b]``/``new[d]`` are known equal."""
    return max([b - o for o, k, n in known if o < b <= o + n and b - o == d - k], default=0)


def _rebuilds(
    old: list[int],
    directives: Sequence[Directive],
    tail: Sequence[int],
    new: list[int],
    known: Known,
) -> bool:
    """``apply_directives(old, directives) + tail == new`` (same checks), comparing only the kept
    runs not ``known`` equal, the replacements and the tail."""
    pos = at = 0
    for start, end, r in [
        (d.start, d.end, d.replacement) for d in sort_and_check(directives, len(old))
    ] + [(len(old), len(old), ())]:
        n = start - pos
        if at + n > len(new) or not _same(old, pos, start, new, at, known):
            return False
        at += n
        if r and tuple(new[at : at + len(r)]) != r:
            return False
        at, pos = at + len(r), end
    return len(new) - at == len(tail) and new[at:] == list(tail)


def align_messages(
    old: Sequence[Mapping[str, Any]],
    new: Sequence[Mapping[str, Any]],
    old_keys: Sequence[Hashable] | None = None,
    new_keys: Sequence[Hashable] | None = None,
) -> list[Opcode]:
    """difflib opcodes between two message lists; messages appended after the last old one get
    their own trailing ``insert`` (a changed last message is paired with the first new one).
    ``old_keys``/``new_keys``: the lists' ``message_key``s where already known.

    Where every old message but a few (not the last) is at the same index in ``new`` (a turn
    that appends, stubs outputs or rewrites the first message), the opcodes are read off that
    (what difflib gives there too, unless a changed message equals another one) and difflib is
    not run."""
    ok = old_keys if old_keys is not None else [message_key(m) for m in old]
    nk = new_keys if new_keys is not None else [message_key(m) for m in new]
    ops = _index_aligned(ok, nk)
    if ops is None:
        ops = difflib.SequenceMatcher(None, ok, nk, autojunk=False).get_opcodes()
    if ops and ops[-1][0] == "replace" and ops[-1][2] == len(old):
        tag, i1, i2, j1, j2 = ops.pop()
        k = min(i2 - i1, j2 - j1)
        ops.append(("replace", i1, i2, j1, j1 + k))
        if j1 + k < j2:
            ops.append(("insert", i2, i2, j1 + k, j2))
    return ops


def _index_aligned(ok: Sequence[Hashable], nk: Sequence[Hashable]) -> list[Opcode] | None:
    """Opcodes when ``nk`` holds ``ok`` at the same indices but for a few messages (at most
    ``_MAX_REPLACED``, not the last old one: each run of them a ``replace``), then appended ones;
    None otherwise (keys compared by identity first: O(messages) pointer checks for keys carried
    over from the last turn)."""
    n = len(ok)
    if len(nk) < n:
        return None
    bad: list[int] = []
    for i in range(n):
        if ok[i] is not nk[i] and ok[i] != nk[i]:
            if len(bad) == _MAX_REPLACED or i == n - 1:
                return None
            bad.append(i)
    ops: list[Opcode] = []
    at = 0
    for i in bad:
        if ops and ops[-1][0] == "replace" and ops[-1][2] == i:  # NOTE: a run of changed ones
            ops[-1] = ("replace", ops[-1][1], i + 1, ops[-1][3], i + 1)
        else:
            if at < i:
                ops.append(("equal", at, i, at, i))
            ops.append(("replace", i, i + 1, i, i + 1))
        at = i + 1
    if at < n:
        ops.append(("equal", at, n, at, n))
    if len(nk) > n:
        ops.append(("insert", n, n, n, len(nk)))
    return ops


_MAX_REPLACED = 8  # changed messages read off by index (a policy stubs a few per turn)


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
    old_modes: Sequence[Mode | None] = (),
    new_modes: Sequence[Mode | None] = (),
    default_mode: Mode = Mode.AMORTIZE,
    tools_changed: bool = False,
    old_keys: Sequence[Hashable] | None = None,
    new_keys: Sequence[Hashable] | None = None,
    known: Known = (),
) -> Diff:
    """The minimal directives that turn the old prompt into the new one's prefix, plus the tail.

    Args:
        old_messages, old: the previous turn's messages and prompt (``Rendered``, or its tokens
            with ``old_spans``); the old tokens may extend past the old prompt (e.g. with the
            generated reply the server also holds).
        new_messages, new: this turn's.
        old_modes, new_modes: per old message, the mode of the edit that dropped it; per new
            message, the mode of the edits behind it (None, or past the list's end: no edit).
            A change of old messages ``[i1, i2)`` into new ones ``[j1, j2)`` gets the strongest
            of their modes.
        default_mode: mode of changes no edit accounts for.
        tools_changed: the tool schemas changed, so unchanged messages may render differently
            (the tools block) without that being a fallback.
        old_keys, new_keys: the lists' ``message_key``s where already known.
        known: runs ``(i, j, n)`` with ``old[i:i + n] == new.tokens[j:j + n]`` known to the
            caller (not compared again; see module docstring).

    Returns:
        ``Diff`` with ``apply_directives(old_tokens, directives) + tail == new.tokens``.
    """
    old_tokens = old.tokens if isinstance(old, Rendered) else old
    old_tokens = old_tokens if isinstance(old_tokens, list) else list(old_tokens)  # not copied
    spans = list(old.spans if isinstance(old, Rendered) else old_spans or [])
    ob = _bounds(Rendered(old_tokens, spans))
    nb = _bounds(new)
    N = new.tokens
    fallback = False
    regions: list[Region] = []

    def add(a: int, b: int, c: int, d: int, mode: Mode | None, same_messages: bool) -> None:
        nonlocal fallback
        if mode is None and (b - a != d - c or not _same(old_tokens, a, b, N, c, known)):
            mode, fallback = default_mode, fallback or (same_messages and not tools_changed)
        regions.append(Region(a, b, c, d, mode))

    if not old_messages or not new_messages:
        ob, nb = [0] * (len(old_messages) + 1), [0] * (len(new_messages) + 1)
    add(0, ob[0], 0, nb[0], None, True)  # template preamble
    j_app = len(new_messages)
    for tag, i1, i2, j1, j2 in align_messages(old_messages, new_messages, old_keys, new_keys):
        if tag == "insert" and i1 == len(old_messages):
            j_app = j1
            break
        if (
            tag == "equal"
            and ob[i2] - ob[i1] == nb[j2] - nb[j1]
            and _same(old_tokens, ob[i1], ob[i2], N, nb[j1], known)
        ):
            # NOTE: a run of unchanged messages whose tokens are unchanged: one region (C speed)
            regions.append(Region(ob[i1], ob[i2], nb[j1], nb[j2], None))
            continue
        pairs = [(i1 + t, i1 + t + 1, j1 + t, j1 + t + 1) for t in range(i2 - i1)]
        if i2 - i1 != j2 - j1:
            pairs = [(i1, i2, j1, j2)]
        for a, b, c, d in pairs:  # message by message where the counts allow
            if tag == "equal":
                add(ob[a], ob[b], nb[c], nb[d], None, True)
            else:
                mode = strongest_mode([*old_modes[a:b], *new_modes[c:d]]) or default_mode
                add(ob[a], ob[b], nb[c], nb[d], mode, False)
    # The old generation prompt (and anything after it) against what now follows.
    g_start, r_start = ob[len(old_messages)], nb[j_app]
    g = common_prefix(old_tokens[g_start:], N[r_start:])
    add(g_start, g_start + g, r_start, r_start + g, None, False)
    add(g_start + g, len(old_tokens), r_start + g, r_start + g, None, False)
    tail = list(N[r_start + g :])

    if known:  # NOTE: runs of changed regions start after, and end before, known equal tokens
        changed = [False, *(r.mode is not None for r in regions), False]
        regions = [
            _trimmed(r, known, not changed[k], not changed[k + 2]) if changed[k + 1] else r
            for k, r in enumerate(regions)
        ]
    directives = region_directives(old_tokens, N, regions)
    if not _rebuilds(old_tokens, directives, tail, N, known):  # never expected; stay exact
        cover = diff_tokens(old_tokens, N, default_mode)
        return Diff(cover.directives, cover.tail, True)
    return Diff(directives, tail, fallback)


def _trimmed(r: Region, known: Known, start: bool, end: bool) -> Region:
    """``r`` less the tokens known equal at its ``start`` and ``end`` (where flagged: a run's
    first and last region), at most the shorter side's: ``token_changes`` trims the common prefix
    and suffix of the run anyway, so the directives and their modes are the same."""
    n = min(r.old_end - r.old_start, r.new_end - r.new_start)
    k = min(n, _known_prefix(known, r.old_start, r.new_start)) if start else 0
    k2 = min(n - k, _known_suffix(known, r.old_end, r.new_end)) if end else 0
    return Region(r.old_start + k, r.old_end - k2, r.new_start + k, r.new_end - k2, r.mode)
