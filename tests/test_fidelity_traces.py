"""The real-model fidelity bench's pure parts (``bench/fidelity/traces.py``): Wilson intervals,
KL from top-k logprobs, fitting a turn into a token budget, the edited-turn cases built from
the shared public traces (rendered with the embedded tokenizer; no server), and ``misses.py``'s
pooling of runs' rows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from shared_data import traces_dir

from leyline_agent.bench.fidelity import misses
from leyline_agent.bench.fidelity import traces as tf
from leyline_agent.chat.model_dir import load_renderer
from leyline_agent.traces import load


def test_wilson_interval() -> None:
    lo, hi = tf.wilson(20, 20)
    assert hi == 1.0 and lo == pytest.approx(0.8389, abs=1e-3)  # 20/20: not "100 %, certain"
    lo, hi = tf.wilson(29, 32)
    assert lo == pytest.approx(0.7578, abs=1e-3) and hi == pytest.approx(0.9676, abs=1e-3)
    assert all(math.isnan(x) for x in tf.wilson(0, 0))


def test_kl_from_top_k() -> None:
    p = {1: math.log(0.7), 2: math.log(0.2), 3: math.log(0.1)}
    assert tf.kl(p, p) == pytest.approx(0.0, abs=1e-12)
    top2 = {1: math.log(0.5), 2: math.log(0.25)}  # a top-k with mass outside it: renormalised
    assert tf.kl(top2, {1: math.log(0.4), 2: math.log(0.2)}) == pytest.approx(0.0, abs=1e-12)
    q = {1: math.log(0.2), 2: math.log(0.7), 3: math.log(0.1)}
    want = 0.7 * math.log(0.7 / 0.2) + 0.2 * math.log(0.2 / 0.7)
    assert tf.kl(p, q) == pytest.approx(want)
    # tokens missing from q's top-k get q's smallest listed logprob
    floor = sum(x * math.log(x * 3) for x in (0.7, 0.2, 0.1))  # q: 1/3 each over p's tokens
    assert tf.kl(p, {1: math.log(0.5)}) == pytest.approx(floor)


def test_fit_keeps_system_and_the_last_messages() -> None:
    msgs = [{"role": "system", "content": "s"}] + [
        {"role": "user", "content": "x" * 10} for _ in range(5)
    ]

    def count(m: list[dict]) -> int:
        return sum(len(x["content"]) for x in m)

    fitted = tf.fit(msgs, count, 31)
    assert fitted == [msgs[0], *msgs[-3:]]
    assert tf.fit(msgs, count, 5) is None


def test_cases_from_the_shared_traces_are_edits_of_fitted_turns() -> None:
    renderer = load_renderer(None)
    traces = [t for t in load(traces_dir()) if t.turns]
    spec = tf.TraceFidelitySpec(budget=1024, n=1000)
    cases = list(tf.cases(traces, renderer, spec))
    assert len(cases) > 20 and {c.policy for c in cases} <= set(spec.policies)
    for c in cases:
        assert len(c.full) <= spec.budget + 4 and c.directives
        new = list(c.full)
        for d in reversed(c.directives):  # applying the directives gives the edited turn
            new[d.start : d.end] = d.replacement
        assert new == c.edited


def _row(policy: str, full: int, amortize: int, forget: int) -> dict:
    return {"policy": policy, "full": [full, 0], "amortize": [amortize, 0], "forget": [forget, 1]}


def test_interleave_takes_each_group_in_turn() -> None:
    """The first n cases hold every (cap, policy) group as evenly as the groups allow."""
    a, b, c = ([f"{g}{i}" for i in range(k)] for g, k in (("a", 3), ("b", 1), ("c", 2)))
    assert tf.interleave([a, b, c]) == ["a0", "b0", "c0", "a1", "c1", "a2"]  # type: ignore[arg-type]
    assert tf.interleave([]) == []


def test_policy_table_counts_first_tokens_per_policy() -> None:
    rows = [
        _row("keep_last=0", 1, 1, 2),
        _row("keep_last=0", 1, 2, 2),
        _row("keep_last=2", 5, 5, 5),
    ]
    lines = tf.policy_table(rows).splitlines()
    lo, hi = tf.wilson(1, 2)
    assert lines[2] == (
        f"| keep_last=0 | 2 | 1/2 (50.0%; {lo:.1%}–{hi:.1%}) | 0/2 (0.0%; 0.0%–{tf.wilson(0, 2)[1]:.1%}) |"
    )
    assert lines[3].startswith("| keep_last=2 | 1 | 1/1 (100.0%;") and len(lines) == 4


def _case(trace: str, turn: int, full: list[int], edited: list[int]) -> tf.Case:
    return tf.Case(trace, turn, "keep_last=1", 300, full, edited, [])


def _full_row(trace: str, turn: int, full: int, fresh: int, amortize: int, forget: int) -> dict:
    return {
        "trace": trace, "turn": turn, "policy": "keep_last=1", "cap": 300,
        "full": [full], "fresh": [fresh], "amortize": [amortize], "forget": [forget],
    }  # fmt: skip


def test_misses_pools_runs_and_counts_distinct_cases(tmp_path: Path) -> None:
    """``misses``: several runs' rows pooled (a case met twice kept once, the first run's row),
    rows whose (full, edited) tokens repeat an earlier row's left out of the distinct set, and
    the cases where the edit changed the answer counted per arm."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    r1, r2 = _full_row("x", 1, 5, 5, 5, 5), _full_row("x", 2, 5, 6, 5, 6)
    r3, r4 = _full_row("y", 1, 7, 8, 8, 8), _full_row("y", 2, 7, 7, 7, 7)
    (a / "cases.jsonl").write_text("\n".join(json.dumps(r) for r in (r1, r2)) + "\n\n")
    again = {**r2, "amortize": [9]}  # the same case in a later run: dropped
    (b / "cases.jsonl").write_text("\n".join(json.dumps(r) for r in (again, r3, r4)) + "\n")
    rows = misses.read_rows([a, b])
    assert rows == [r1, r2, r3, r4]
    cases = [
        _case("x", 1, [1, 2, 3], [1, 3]),
        _case("x", 2, [1, 2, 4], [1, 4]),
        _case("y", 1, [1, 2, 3], [1, 3]),  # the same tokens as x turn 1: not distinct
    ]  # y turn 2 has no case: kept
    assert misses.distinct(rows, cases) == [r1, r2, r4]
    assert misses.changed(rows) == (
        "edit changed the first token (fresh != full): 2 of 4; AMORTIZE kept the full "
        "context's in 1, FORGET followed the fresh prefill in 2"
    )
