"""The splice planner for paged KV pools (``--page-size`` > 1); pure Python, like ``plan.py``.

A paged allocator (SGLang's ``PagedTokenToKVPoolAllocator``) hands out whole pages and keeps each
page's positions contiguous: position ``p`` of a sequence sits at a slot ``s`` with
``s % page == p % page``, and positions ``[k·page, (k+1)·page)`` share one physical page. The
paged radix cache holds full pages only (keys and matches are cut to page multiples), so a
cached sequence of ``L`` tokens holds ``held = L // page · page`` of them.

What changes against ``plan.py`` (whose ops and executor are reused):

- ``clip``: the splice covers the held part ``tokens[:held]``; a directive reaching into the
  uncached partial page is cut at ``held`` (its replacement kept whole), one starting at or past
  ``held`` is left out (the next request prefills that part, as SGLang would anyway).
- The kept prefix ends on a page boundary, ``floor(first)``: the head of the page holding the
  first directive's start (``[floor(first), first)``) is copied into a fresh page (``Copy``),
  which the replacement prefill then completes (SGLang's ``alloc_extend`` continues the page of
  the prefix's last slot).
- Every other row of the new sequence past ``floor(first)`` goes to fresh pages (moved and
  δ-rotated: ``Rotate(in_place=False)``), except the tail's full pages when the splice may take
  the tail in place and its shift is a multiple of the page: those stay where they are and are
  rotated there (the rows of the tail's first, partial page move).
- FORGET purges whole pages: from ``floor(forget_at)`` on. A FORGET that starts in the uncached
  partial page (no other FORGET) leaves the plan as without it and names that page's tokens
  (``forget_tail``): the executor purges the pages below the sequence that begin with them (the
  previous reply's, which hold the forgotten tokens).
- ``needed_slots``: whole fresh pages.

``floor(x) = x // page · page``. With ``page == 1`` every plan equals ``plan_splice``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from leyline_agent.backends.sglang.plan import (
    Copy,
    Keep,
    Op,
    Purge,
    Rotate,
    SplicePlan,
    plan_splice,
)
from leyline_agent.directive import Directive, Mode, plan_edit


@dataclass(frozen=True)
class PagedPlan(SplicePlan):
    """A ``SplicePlan`` over the held part of the sequence, with the page size. ``first`` is the
    page-aligned start of what the splice rewrites (the kept prefix ends there); ``full_length``
    is the edited sequence's length with every directive (the plan's ``new_tokens`` may stop
    earlier: ``clip``)."""

    page: int = 1
    full_length: int = 0
    forget_tail: tuple[int, ...] = ()  # FORGET only in the uncached partial page: its tokens

    @property
    def fresh_new(self) -> range:
        """New positions backed by fresh slots: from ``first`` (0 across namespaces) to the
        in-place tail's start or the end."""
        start, tail = self.first, self.tail
        stop = tail.new.start if tail is not None else len(self.new_tokens)
        return range(start, max(start, stop))

    @property
    def needed_slots(self) -> int:
        """Fresh slots in whole pages."""
        n = len(self.fresh_new)
        return -(-n // self.page) * self.page


def floor_page(x: int, page: int) -> int:
    return x // page * page


def clip(ordered: Sequence[Directive], held: int, length: int | None = None) -> list[Directive]:
    """``ordered`` (sorted, non-overlapping) restricted to the held positions ``[0, held)`` of a
    sequence of ``length`` tokens (default ``held``): a directive starting at or past ``held``
    is left out (unless ``held == length``: an insertion at the end), one ending past it is cut
    there (keeping its replacement and mode)."""
    out = []
    for d in ordered:
        if d.start > held or (d.start == held and held != (held if length is None else length)):
            continue
        out.append(d if d.end <= held else d.model_copy(update={"end": held}))
    return out


def plan_paged(
    tokens: Sequence[int],
    ordered: Sequence[Directive],
    *,
    held: int,
    page: int,
    in_place: bool,
    copy_prefix: bool = False,
) -> PagedPlan:
    """Plan a splice of ``tokens`` (of which the first ``held``, a page multiple, are cached)
    with ``ordered`` directives (``sort_and_check``'s output) on a pool of ``page``-token pages.

    ``in_place`` and ``copy_prefix`` as ``plan_splice``. With no directive left after ``clip``
    (and not ``copy_prefix``) the plan keeps the held sequence as it is.

    Raises:
        ValueError: ``held`` not a page multiple or past the sequence, ``page < 1``.
        DirectiveError: as ``plan_edit``.
    """
    if page < 1 or held % page or not 0 <= held <= len(tokens):
        raise ValueError(f"held {held} must be a multiple of page {page} within the sequence")
    full_length = len(plan_edit(tokens, ordered).new_tokens) if ordered else len(tokens)
    kept = list(tokens[:held])
    clipped = clip(ordered, held, len(tokens))
    forget = [d for d in ordered if d.mode is Mode.FORGET]
    tail = (
        tuple(tokens[held:])
        if forget and all(held <= d.start < len(tokens) for d in forget)
        else ()
    )
    if not clipped and not copy_prefix:
        return PagedPlan(
            ops=(Keep(range(held)),) if held else (),
            new_tokens=kept,
            first=held,
            forget_at=None,
            in_place=False,
            page=page,
            full_length=full_length,
            forget_tail=tail,
        )
    base = plan_splice(kept, clipped, in_place=in_place, copy_prefix=copy_prefix)
    first = floor_page(base.first, page)
    ops: list[Op] = []
    for op in base.ops:
        if isinstance(op, Keep):
            ops.append(Keep(range(first)))
            if first < op.old.stop:
                ops.append(Copy(range(first, op.old.stop)))
        elif isinstance(op, Rotate) and op.in_place:
            ops += _split_tail(op, page)
        elif isinstance(op, Purge):
            ops.append(Purge(floor_page(op.old, page)))
        else:
            ops.append(op)
    return PagedPlan(
        ops=tuple(ops),
        new_tokens=base.new_tokens,
        first=0 if copy_prefix else first,
        forget_at=base.forget_at,
        in_place=base.in_place,  # a moved tail still takes (and drops) the old chain
        page=page,
        full_length=full_length,
        forget_tail=tail,
    )


def _split_tail(tail: Rotate, page: int) -> list[Rotate]:
    """The in-place tail on pages: rotated in place from its first page boundary on when its
    shift is a page multiple (the rows before that boundary move to fresh slots), else moved
    whole."""
    boundary = -(-tail.old.start // page) * page
    if tail.delta % page or boundary >= tail.old.stop:
        return [tail._replace(in_place=False)]
    head = range(tail.old.start, boundary)
    out = [Rotate(head, tail.delta, in_place=False)] if head else []
    return [*out, Rotate(range(boundary, tail.old.stop), tail.delta, in_place=True)]
