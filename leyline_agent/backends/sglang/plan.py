"""The splice planner: which slots of the new sequence are kept, prefilled, rotated or purged.

Pure Python (no torch, no sglang): ``splice.py`` executes the ops, tests check them anywhere.

Ops, in new-sequence order (``new`` ranges are positions of the edited sequence, ``old`` ranges
positions of the cached one; see the region table at the top of ``splice.py``)::

    Keep(old)                    prefix [0, d_0.start): tree-owned slots reused as they are
    Copy(old)                    the same prefix copied to fresh slots as it is (a splice into
                                 another namespace, a fork: no slot is shared across namespaces)
    Prefill(new, tokens)         a replacement, prefilled attending to new[:new.start]
    Rotate(old, delta, in_place) a middle or the tail: copied to fresh slots and δ-rotated, or
                                 (the tail only) rotated in place once the commit detached it
    PrefillFrom(old, new, tokens) FORGET at old position ``old``: everything from new.start on
                                 is re-prefilled
    Purge(old)                   FORGET (commit): tree nodes holding old positions >= old go

Every op but ``Purge`` fills the next stretch of the new sequence, so they tile
``[0, len(new_tokens))``. ``needed_slots`` is how many fresh slots that takes: every position
that is neither a ``Keep`` nor an in-place ``Rotate``.

A splice into another namespace (``copy_prefix``) copies instead of keeping and never works in
place; a fork is that with no directive (one ``Copy`` of the whole sequence).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from leyline_agent.directive import Directive, Mode, plan_edit


class Keep(NamedTuple):
    old: range  # also the new positions (the prefix does not move)

    @property
    def new(self) -> range:
        return self.old


class Copy(NamedTuple):
    old: range  # also the new positions (the prefix does not move)

    @property
    def new(self) -> range:
        return self.old


class Prefill(NamedTuple):
    new: range
    tokens: tuple[int, ...]


class Rotate(NamedTuple):
    old: range
    delta: int  # new position = old position + delta
    in_place: bool  # False: copy to fresh slots first (another path shares them)

    @property
    def new(self) -> range:
        return range(self.old.start + self.delta, self.old.stop + self.delta)


class PrefillFrom(NamedTuple):
    old: int  # forget_at: the first FORGET directive's start
    new: range  # to the end of the new sequence (possibly empty)
    tokens: tuple[int, ...]


class Purge(NamedTuple):
    old: int  # purge the path's nodes from this old position on (and their subtrees)


Op = Keep | Copy | Prefill | Rotate | PrefillFrom | Purge


@dataclass(frozen=True)
class SplicePlan:
    """``ops`` in new-sequence order (``Purge`` last); ``first``: the first directive's start
    (the reused prefix); ``in_place``: the tail is taken in place (the commit detaches the old
    chain from ``first`` and drops what the new sequence does not keep)."""

    ops: tuple[Op, ...]
    new_tokens: list[int]
    first: int
    forget_at: int | None
    in_place: bool

    @property
    def needed_slots(self) -> int:
        """Fresh slots the splice allocates: new positions not backed by a kept slot."""
        return self.prefilled + self.copied + self.copied_prefix

    @property
    def copied_prefix(self) -> int:
        return sum(len(op.old) for op in self.ops if isinstance(op, Copy))

    @property
    def prefilled(self) -> int:
        return sum(len(op.new) for op in self.ops if isinstance(op, (Prefill, PrefillFrom)))

    @property
    def rotated(self) -> int:
        return sum(len(op.old) for op in self.ops if isinstance(op, Rotate))

    @property
    def copied(self) -> int:
        return sum(len(op.old) for op in self.ops if isinstance(op, Rotate) and not op.in_place)

    @property
    def tail(self) -> Rotate | None:
        """The in-place tail rotation (phase 2), if any."""
        return next((op for op in self.ops if isinstance(op, Rotate) and op.in_place), None)

    @property
    def purge(self) -> Purge | None:
        return next((op for op in self.ops if isinstance(op, Purge)), None)


def forget_start(ordered: Sequence[Directive]) -> int | None:
    """The first FORGET directive's start, or None."""
    return min((d.start for d in ordered if d.mode is Mode.FORGET), default=None)


def plan_splice(
    tokens: Sequence[int],
    ordered: Sequence[Directive],
    *,
    in_place: bool,
    copy_prefix: bool = False,
) -> SplicePlan:
    """Plan a splice of the cached ``tokens`` (all cached) with ``ordered`` directives
    (``sort_and_check``'s output, at least one unless ``copy_prefix``).

    ``in_place``: the tree says this path alone owns the chain from the first directive on (and
    the unshared extension below it); it only matters without FORGET, which always copies.
    AMORTIZE directives at or after ``forget_at`` are part of the re-prefill.
    ``copy_prefix``: the new sequence goes into another namespace: the prefix is copied, nothing
    is taken in place; with no directive, the plan is a fork (the whole sequence copied).

    Raises:
        DirectiveError: as ``plan_edit`` (overlap, a directive past the sequence).
        ValueError: no directives (and not ``copy_prefix``).
    """
    if not ordered and not copy_prefix:
        raise ValueError("a splice needs at least one directive")
    new_tokens = plan_edit(tokens, ordered).new_tokens if ordered else list(tokens)
    cached = len(tokens)
    forget_at = forget_start(ordered)
    amortized = [d for d in ordered if forget_at is None or d.start < forget_at]
    stop = cached if forget_at is None else forget_at  # old positions the AMORTIZE part covers
    tail_in_place = in_place and forget_at is None and not copy_prefix
    prefix = range(0, amortized[0].start if amortized else stop)
    keep: Keep | Copy = Copy(prefix) if copy_prefix else Keep(prefix)
    ops: list[Op] = [keep]
    pos = len(keep.old)  # next new position
    acc = 0
    for i, d in enumerate(amortized):
        if d.replacement:
            ops.append(Prefill(range(pos, pos + len(d.replacement)), d.replacement))
            pos += len(d.replacement)
        acc += d.delta
        last = i + 1 == len(amortized)
        seg = range(d.end, stop if last else min(amortized[i + 1].start, stop))
        if seg:
            ops.append(Rotate(seg, acc, in_place=last and tail_in_place))
            pos += len(seg)
    if forget_at is not None:
        ops.append(PrefillFrom(forget_at, range(pos, len(new_tokens)), tuple(new_tokens[pos:])))
        ops.append(Purge(forget_at))
    return SplicePlan(
        ops=tuple(ops),
        new_tokens=new_tokens,
        first=ordered[0].start if ordered else cached,
        forget_at=forget_at,
        in_place=tail_in_place,
    )
