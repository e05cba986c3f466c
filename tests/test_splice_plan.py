"""The splice planner (``backends/sglang/plan.py``): pure Python, runs without SGLang or torch.

Properties over generated sequences and directive sets: the ops tile the new sequence, applying
them to a token list gives the edited sequence, every kept position moves by its directive shift,
the fresh slots are exactly the new positions, and the plan reproduces, step for step, what the
executor's loop did before it was split out (``legacy_phase1``, kept here as the reference).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leyline_agent.backends.sglang.plan import (
    Copy,
    Keep,
    Op,
    Prefill,
    PrefillFrom,
    Purge,
    Rotate,
    SplicePlan,
    plan_splice,
)
from leyline_agent.directive import Directive, Mode, plan_edit, position_shifts, sort_and_check


@st.composite
def splices(draw: st.DrawFn) -> tuple[list[int], list[Directive], bool]:
    n = draw(st.integers(0, 40))
    tokens = draw(st.lists(st.integers(0, 999), min_size=n, max_size=n))
    cuts = sorted(draw(st.lists(st.integers(0, n), min_size=2, max_size=8)))
    directives: list[Directive] = []
    last_start = -1
    for a, b in zip(cuts[::2], cuts[1::2], strict=False):
        if a == last_start or (directives and a < directives[-1].end):
            continue
        repl = draw(st.lists(st.integers(1000, 1999), max_size=5))
        mode = draw(st.sampled_from([Mode.AMORTIZE, Mode.AMORTIZE, Mode.FORGET]))
        directives.append(Directive(start=a, end=b, replacement=repl, mode=mode))
        last_start = a
    if not directives:
        directives = [Directive(start=0, end=0, replacement=[7])]
    shuffled = draw(st.permutations(directives))
    return tokens, sort_and_check(shuffled, n), draw(st.booleans())


def apply_ops(tokens: list[int], ops: tuple[Op, ...]) -> list[int]:
    out: list[int] = []
    for op in ops:
        if isinstance(op, (Keep, Copy, Rotate)):
            out += [tokens[i] for i in op.old]
        elif isinstance(op, (Prefill, PrefillFrom)):
            out += op.tokens
    return out


def naive_edit(tokens: list[int], ordered: list[Directive]) -> list[int]:
    out = list(tokens)
    for d in reversed(ordered):  # right to left: no directive disturbs another's offsets
        out[d.start : d.end] = d.replacement
    return out


def legacy_phase1(tokens: list[int], ordered: list[Directive], in_place: bool) -> dict:
    """The executor's planning before ``plan.py``, on integer slots instead of tensors: old slot
    ``i`` is ``i``, fresh slots are negative. Returns the steps it took, counts and needed."""
    cached = len(tokens)
    old_slots = list(range(cached))
    new_tokens = plan_edit(tokens, ordered).new_tokens
    forget_at = min((d.start for d in ordered if d.mode is Mode.FORGET), default=None)
    amortized = [d for d in ordered if forget_at is None or d.start < forget_at]
    first = ordered[0].start
    needed = len(new_tokens) - first
    if in_place and forget_at is None and amortized:
        needed -= cached - amortized[-1].end
    parts: list[list[int]] = [old_slots[: amortized[0].start if amortized else forget_at]]
    counts = {"prefilled": 0, "rotated": 0, "copied": 0}
    steps: list[tuple] = []
    acc = 0
    for i, d in enumerate(amortized):
        prefix = sum(parts, [])
        if d.replacement:
            upto = len(prefix) + len(d.replacement)
            steps.append(("prefill", len(prefix), upto))
            parts.append([-1] * len(d.replacement))
            counts["prefilled"] += len(d.replacement)
        acc += d.delta
        seg_end = amortized[i + 1].start if i + 1 < len(amortized) else cached
        if forget_at is not None:
            seg_end = min(seg_end, forget_at)
        seg = old_slots[d.end : seg_end]
        if not seg:
            continue
        if i + 1 == len(amortized) and forget_at is None and in_place:
            parts.append(seg)
            steps.append(("tail", d.end, seg_end, acc))
        else:
            steps.append(("copy", d.end, seg_end, acc))
            parts.append([-2] * len(seg))
            counts["copied"] += len(seg)
        counts["rotated"] += len(seg)
    if forget_at is not None:
        prefix_len = len(sum(parts, []))
        steps.append(("prefill", prefix_len, len(new_tokens)))
        counts["prefilled"] += len(new_tokens) - prefix_len
        parts.append([-1] * (len(new_tokens) - prefix_len))
    assert len(sum(parts, [])) == len(new_tokens)
    return {"steps": steps, "counts": counts, "needed": needed, "forget_at": forget_at}


def plan_steps(plan: SplicePlan) -> list[tuple]:
    steps: list[tuple] = []
    for op in plan.ops:
        if isinstance(op, (Prefill, PrefillFrom)):
            steps.append(("prefill", op.new.start, op.new.stop))
        elif isinstance(op, Rotate):
            steps.append(("tail" if op.in_place else "copy", op.old.start, op.old.stop, op.delta))
    return steps


@settings(max_examples=400, deadline=None)
@given(splices())
def test_ops_tile_the_new_sequence_and_apply_to_the_edit(case) -> None:
    tokens, ordered, in_place = case
    plan = plan_splice(tokens, ordered, in_place=in_place)
    assert plan.new_tokens == naive_edit(tokens, ordered)
    assert apply_ops(tokens, plan.ops) == plan.new_tokens
    filling = [op for op in plan.ops if not isinstance(op, Purge)]
    pos = 0
    for op in filling:
        assert op.new.start == pos, plan.ops
        pos = op.new.stop
    assert pos == len(plan.new_tokens)
    assert isinstance(plan.ops[0], Keep) and plan.ops[0].old == range(plan.first)


@settings(max_examples=400, deadline=None)
@given(splices())
def test_kept_positions_move_by_their_shift(case) -> None:
    tokens, ordered, in_place = case
    plan = plan_splice(tokens, ordered, in_place=in_place)
    shifts = position_shifts(len(tokens), ordered)
    for op in plan.ops:
        if isinstance(op, Keep):
            assert all(shifts[i] == 0 for i in op.old)
        elif isinstance(op, Rotate):
            assert all(shifts[i] == op.delta for i in op.old)
            assert plan.forget_at is None or op.old.stop <= plan.forget_at
    old_used = [i for op in plan.ops if isinstance(op, (Keep, Rotate)) for i in op.old]
    assert old_used == sorted(set(old_used))  # each old slot used at most once, in order


@settings(max_examples=400, deadline=None)
@given(splices())
def test_needed_slots_are_the_new_positions(case) -> None:
    tokens, ordered, in_place = case
    plan = plan_splice(tokens, ordered, in_place=in_place)
    reused = sum(len(op.old) for op in plan.ops if isinstance(op, Rotate) and op.in_place)
    keep = len(plan.ops[0].new)
    assert plan.needed_slots == len(plan.new_tokens) - keep - reused
    assert plan.needed_slots == plan.prefilled + plan.copied
    tails = [op for op in plan.ops if isinstance(op, Rotate) and op.in_place]
    assert len(tails) <= 1 and (not tails or plan.in_place)
    assert not tails or (tails[0] == plan.ops[-1] and tails[0].old.stop == len(tokens))


@settings(max_examples=400, deadline=None)
@given(splices())
def test_plan_matches_the_executor_loop_it_replaced(case) -> None:
    tokens, ordered, in_place = case
    plan = plan_splice(tokens, ordered, in_place=in_place)
    ref = legacy_phase1(tokens, ordered, in_place)
    assert plan_steps(plan) == ref["steps"]
    assert plan.needed_slots == ref["needed"]
    assert plan.forget_at == ref["forget_at"]
    assert {"prefilled": plan.prefilled, "rotated": plan.rotated, "copied": plan.copied} == ref[
        "counts"
    ]
    assert (plan.purge is not None) == (plan.forget_at is not None)
    assert plan.in_place == (in_place and plan.forget_at is None)


def test_examples() -> None:
    toks = list(range(10))
    a = Directive(start=2, end=4, replacement=[50])
    b = Directive(start=6, end=7)
    plan = plan_splice(toks, [a, b], in_place=True)
    assert plan.ops == (
        Keep(range(0, 2)),
        Prefill(range(2, 3), (50,)),
        Rotate(range(4, 6), -1, in_place=False),
        Rotate(range(7, 10), -2, in_place=True),
    )
    assert (plan.needed_slots, plan.rotated, plan.copied, plan.first) == (3, 5, 2, 2)
    f = Directive(start=5, end=6, replacement=[60, 61], mode=Mode.FORGET)
    plan = plan_splice(toks, [a, f], in_place=True)
    assert plan.ops == (
        Keep(range(0, 2)),
        Prefill(range(2, 3), (50,)),
        Rotate(range(4, 5), -1, in_place=False),
        PrefillFrom(5, range(4, 10), (60, 61, 6, 7, 8, 9)),
        Purge(5),
    )
    assert not plan.in_place and plan.needed_slots == 8
    with pytest.raises(ValueError, match="at least one"):
        plan_splice(toks, [], in_place=False)


@settings(max_examples=400, deadline=None)
@given(splices())
def test_across_namespaces_every_position_is_a_fresh_slot(case) -> None:
    """``copy_prefix`` (a splice into another namespace): the same ops with the prefix copied,
    nothing in place, and every new position needs a fresh slot (no slot shared with the
    source namespace)."""
    tokens, ordered, in_place = case
    same = plan_splice(tokens, ordered, in_place=False)
    plan = plan_splice(tokens, ordered, in_place=in_place, copy_prefix=True)
    assert plan.new_tokens == same.new_tokens == naive_edit(tokens, ordered)
    assert apply_ops(tokens, plan.ops) == plan.new_tokens
    assert isinstance(plan.ops[0], Copy) and plan.ops[0].old == range(plan.first)
    assert plan.ops[1:] == same.ops[1:] and not plan.in_place and plan.tail is None
    assert plan.needed_slots == len(plan.new_tokens)
    assert plan.copied_prefix == plan.first


def test_a_fork_is_one_copy_of_the_whole_sequence() -> None:
    plan = plan_splice([5, 6, 7], [], in_place=True, copy_prefix=True)
    assert plan.ops == (Copy(range(3)),) and plan.new_tokens == [5, 6, 7]
    assert plan.needed_slots == 3 and plan.first == 3 and plan.forget_at is None
    with pytest.raises(ValueError):
        plan_splice([5, 6, 7], [], in_place=False)
