"""The paged splice planner (``backends/sglang/paged_plan.py``) and the paged slot helpers
(``paged.py``): no server.

Properties over generated sequences, directive sets and page sizes: at page 1 the plan is
``plan_splice``'s; the ops tile the new sequence and give the clipped edit; kept and in-place rows
sit on page boundaries with page-multiple shifts; FORGET purges from a page boundary; and the
slots an executor would hand out (``fresh_slots`` over a fake page allocator) keep every page of
positions in one physical page, ``slot % page == position % page``, with ``needed_slots`` fresh
slots in whole pages.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_splice_plan import apply_ops, splices

from leyline_agent.backends.sglang.paged import fresh_slots, release
from leyline_agent.backends.sglang.paged_plan import clip, floor_page, plan_paged
from leyline_agent.backends.sglang.plan import (
    Copy,
    Keep,
    Prefill,
    PrefillFrom,
    Purge,
    Rotate,
    plan_splice,
)
from leyline_agent.directive import Directive, plan_edit


@settings(max_examples=300, deadline=None)
@given(splices())
def test_page_one_is_plan_splice(case) -> None:
    tokens, ordered, in_place = case
    paged = plan_paged(tokens, ordered, held=len(tokens), page=1, in_place=in_place)
    plain = plan_splice(tokens, ordered, in_place=in_place)
    assert paged.ops == plain.ops and paged.new_tokens == plain.new_tokens
    assert paged.first == plain.first and paged.in_place == plain.in_place
    assert paged.needed_slots == plain.needed_slots


def simulate(plan, page: int, held: int) -> torch.Tensor:
    """The executor's slot assignment on integers: old position i at slot 1000·page + i (page
    aligned), fresh pages from a counter; returns the new sequence's slots."""
    next_page = [1]

    def alloc(k: int) -> torch.Tensor:
        assert k % page == 0
        out = torch.arange(next_page[0] * page, next_page[0] * page + k)
        next_page[0] += k // page
        return out

    old = torch.arange(1000 * page, 1000 * page + held)
    parts: list[torch.Tensor] = []
    for op in plan.ops:
        last = next((int(p[-1]) for p in reversed(parts) if p.numel()), None)
        if isinstance(op, Keep) or (isinstance(op, Rotate) and op.in_place):
            parts.append(old[op.old.start : op.old.stop])
        elif isinstance(op, (Copy, Rotate)):
            parts.append(fresh_slots(alloc, page, last, op.new.start, len(op.old)))
        elif isinstance(op, (Prefill, PrefillFrom)):  # SGLang's alloc_extend: the same rule
            parts.append(fresh_slots(alloc, page, last, op.new.start, len(op.new)))
    slots = torch.cat(parts) if parts else torch.empty((0,), dtype=torch.int64)
    fresh = int((slots < 1000 * page).sum())
    assert (next_page[0] - 1) * page == plan.needed_slots or fresh == 0
    return slots


@settings(max_examples=400, deadline=None)
@given(splices(), st.sampled_from([2, 4, 16]))
def test_paged_plan_tiles_and_keeps_pages_whole(case, page: int) -> None:
    tokens, ordered, in_place = case
    held = floor_page(len(tokens), page)
    plan = plan_paged(tokens, ordered, held=held, page=page, in_place=in_place)
    clipped = clip(ordered, held, len(tokens))
    expect = plan_edit(tokens[:held], clipped).new_tokens if clipped else tokens[:held]
    assert plan.new_tokens == expect == apply_ops(tokens, plan.ops)
    assert plan.full_length == len(plan_edit(tokens, ordered).new_tokens)
    assert plan.first % page == 0
    pos = 0
    for op in plan.ops:
        if isinstance(op, Purge):
            assert op.old % page == 0
            continue
        assert op.new.start == pos
        pos = op.new.stop
        if isinstance(op, Keep):
            assert op.old.stop % page == 0 and op.old.stop == plan.first
        if isinstance(op, Rotate) and op.in_place:
            assert op.old.start % page == 0 and op.delta % page == 0 and op.old.stop == held
    assert pos == len(plan.new_tokens)
    slots = simulate(plan, page, held)
    n = int(slots.numel())
    p = torch.arange(n)
    assert bool((slots % page == p % page).all())
    assert bool((slots // page == slots[p // page * page] // page).all())
    assert int(torch.unique(slots).numel()) == n


def test_clip_cuts_at_the_held_pages() -> None:
    ds = [
        Directive(start=3, end=5, replacement=[1]),
        Directive(start=14, end=20, replacement=[2, 3]),
        Directive(start=20, end=22, replacement=[]),
    ]
    assert clip(ds, 16, 22) == [ds[0], Directive(start=14, end=16, replacement=[2, 3])]
    plan = plan_paged(list(range(22)), ds, held=16, page=16, in_place=True)
    assert plan.new_tokens == [0, 1, 2, 1, *range(5, 14), 2, 3]
    assert plan.full_length == 22 - 1 - 4 - 2


def test_delta_multiple_of_page_keeps_tail_pages_in_place() -> None:
    tokens = list(range(100))
    d = Directive(start=21, end=37, replacement=[])  # delta -16
    plan = plan_paged(tokens, [d], held=96, page=16, in_place=True)
    assert plan.ops == (
        Keep(range(16)),
        Copy(range(16, 21)),
        Rotate(range(37, 48), -16, in_place=False),
        Rotate(range(48, 96), -16, in_place=True),
    )
    assert plan.needed_slots == 16  # one fresh page: rows 16..31 of the new sequence
    odd = plan_paged(tokens, [d.model_copy(update={"end": 30})], held=96, page=16, in_place=True)
    assert odd.tail is None and odd.in_place  # delta -9: every row moves, the old chain goes
    assert odd.ops[-1] == Rotate(range(30, 96), -9, in_place=False)
    assert odd.needed_slots == 16 * 5  # new positions 16..86 on fresh pages


def test_forget_purges_whole_pages_and_no_directive_keeps_all() -> None:
    tokens = list(range(70))
    f = Directive(start=40, end=45, replacement=[7], mode="forget")
    plan = plan_paged(tokens, [f], held=64, page=16, in_place=False)
    assert plan.purge == Purge(32) and plan.ops[0] == Keep(range(32))
    late = plan_paged(tokens, [Directive(start=66, end=68, replacement=[])], held=64, page=16,
                      in_place=True)  # fmt: skip
    assert late.ops == (Keep(range(64)),) and late.needed_slots == 0 and not late.in_place
    assert late.forget_tail == () and plan.forget_tail == ()
    tail = plan_paged(tokens, [f.model_copy(update={"start": 66, "end": 68})], held=64, page=16,
                      in_place=True)  # fmt: skip
    assert tail.ops == (Keep(range(64)),) and tail.forget_tail == tuple(range(64, 70))
    with pytest.raises(ValueError, match="multiple of page"):
        plan_paged(tokens, [f], held=60, page=16, in_place=False)


class FakePagedAllocator:
    """The two attributes ``release`` reads and the paged ``free`` (whole pages)."""

    page_size = 4

    def __init__(self) -> None:
        self.free_pages = torch.tensor([7, 8], dtype=torch.int64)
        self.staged_pages: list[torch.Tensor] = []
        self.freed: list[torch.Tensor] = []

    def free(self, slots: torch.Tensor) -> None:
        pages = torch.unique(slots // self.page_size)
        self.freed.append(pages)
        self.free_pages = torch.cat([self.free_pages, pages])


def test_release_frees_each_page_once_and_skips_free_ones() -> None:
    a = FakePagedAllocator()
    head = torch.tensor([8, 9, 10, 11])  # page 2, the whole page
    prefill = torch.tensor([10, 11, 12])  # continues page 2, then page 3
    already = torch.tensor([28, 29])  # page 7: already free
    release(a, [head, prefill, already, None])
    assert [p.tolist() for p in a.freed] == [[2, 3]]
