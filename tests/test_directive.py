"""The directive model: validation, JSON round-trip, one-edit application, position shifts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from leyline_agent import Directive, DirectiveError, Mode, apply_directives, plan_edit
from leyline_agent.directive import position_shifts, sort_and_check


def test_defaults_delta_and_json_round_trip() -> None:
    d = Directive(start=3, end=7, replacement=[1, 2])
    assert d.mode is Mode.AMORTIZE
    assert d.delta == -2 and d.removed == 4
    again = Directive.model_validate_json(d.model_dump_json())
    assert again == d
    f = Directive.model_validate({"start": 0, "end": 0, "replacement": [9], "mode": "forget"})
    assert f.mode is Mode.FORGET and f.delta == 1


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"start": -1, "end": 2}, "greater than or equal to 0"),
        ({"start": 0, "end": -2}, "greater than or equal to 0"),
        ({"start": 5, "end": 2}, "start (5) must be <= end (2)"),
        ({"start": 0, "end": 1, "replacement": [1.5]}, "valid integer"),
        ({"start": 0, "end": 1, "replacement": ["7"]}, "valid integer"),
        ({"start": 0, "end": 1, "replacement": [-3]}, "must be >= 0"),
        ({"start": 0, "end": 1, "mode": "erase"}, "amortize"),
        ({"start": 0, "end": 1, "unknown": 1}, "Extra inputs"),
    ],
    ids=["neg-start", "neg-end", "start>end", "float", "str", "neg-token", "mode", "extra"],
)
def test_validation_errors_say_what_to_fix(body: dict, needle: str) -> None:
    with pytest.raises(ValidationError) as e:
        Directive.model_validate(body)
    assert needle in str(e.value)


def test_apply_and_end_past_sequence() -> None:
    assert Directive(start=1, end=3, replacement=[9]).apply([0, 1, 2, 3]) == [0, 9, 3]
    assert Directive(start=4, end=4, replacement=[7]).apply([0, 1, 2, 3]) == [0, 1, 2, 3, 7]
    with pytest.raises(DirectiveError, match="ends past the sequence"):
        Directive(start=2, end=5).apply([0, 1, 2, 3])


def test_overlap_rules() -> None:
    a = Directive(start=2, end=5)
    with pytest.raises(DirectiveError, match="overlap"):
        sort_and_check([a, Directive(start=4, end=6)])
    with pytest.raises(DirectiveError, match="overlap"):  # two insertions at one point
        sort_and_check([Directive(start=3, end=3, replacement=[1]), Directive(start=3, end=3)])
    with pytest.raises(DirectiveError, match="overlap"):  # same start
        sort_and_check([Directive(start=2, end=2, replacement=[1]), a])
    # adjacent spans are fine, and order of the input does not matter
    assert sort_and_check([Directive(start=5, end=6), a]) == [a, Directive(start=5, end=6)]


@st.composite
def edit_case(draw: st.DrawFn) -> tuple[list[int], list[Directive]]:
    n = draw(st.integers(0, 40))
    tokens = draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=8)))
    directives, prev_end = [], -1
    for a, b in zip(cuts[::2], cuts[1::2], strict=False):
        if a <= prev_end:
            continue
        repl = draw(st.lists(st.integers(0, 1000), max_size=5))
        directives.append(Directive(start=a, end=b, replacement=repl))
        prev_end = b
    order = draw(st.permutations(directives))
    return tokens, list(order)


@settings(max_examples=300, deadline=None)
@given(edit_case())
def test_one_edit_equals_right_to_left_application(case: tuple[list[int], list[Directive]]) -> None:
    tokens, directives = case
    expected = list(tokens)
    for d in sorted(directives, key=lambda d: d.start, reverse=True):
        expected[d.start : d.end] = d.replacement
    plan = plan_edit(tokens, directives)
    assert plan.new_tokens == expected == apply_directives(tokens, directives)
    assert len(plan.new_tokens) == len(tokens) + sum(d.delta for d in directives)
    # every kept token sits at old position + its shift, with its own id
    shifts = position_shifts(len(tokens), directives)
    kept_old = {old for old, _ in plan.kept}
    for old, new in plan.kept:
        assert plan.new_tokens[new] == tokens[old]
        assert new - old == shifts[old]
    for i, s in enumerate(shifts):
        assert (s is None) == (i not in kept_old)
    # replacements land where the plan says
    for d, (s, e) in zip(sorted(directives, key=lambda d: d.start), plan.inserted, strict=True):
        assert plan.new_tokens[s:e] == list(d.replacement)
