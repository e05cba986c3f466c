"""What ``leyline replay`` prints: a table that fits 80 columns with every arm's name and figures
whole, the result in words, the edited-turn latency ratio, argmax "n/a flat" on flat logits."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from leyline_agent.replay.report import FLAT_MARGIN, arm_totals, headline, summarize
from leyline_agent.replay.runner import LevelResult, top_margin
from leyline_agent.replay.spec import ReplaySpec, TurnRow
from leyline_agent.replay.table import argmax_cell, in_words, table


def _row(arm: str, turn: int, **kw: object) -> TurnRow:
    base = dict(
        turn=turn, prompt_tokens=100, server_cached_tokens=60, prefilled_tokens=40,
        best_reused_tokens=60, level=1, arm=arm, trace="t", turn_ms=10.0, reused_tokens=60,
    )  # fmt: skip
    return TurnRow(**{**base, **kw})


def _readme_rows() -> list[TurnRow]:
    """Per arm an unedited turn and an edited one, with the README's totals (10,065 / 17,045 /
    10,245 tokens prefilled; on the edited turns 12,940 against 6,140 and 2.07 s against 1.40 s)."""
    big = dict(prompt_tokens=30000, server_cached_tokens=25000, reused_tokens=25000)
    return [
        _row("none", 0, prefilled_tokens=5000, turn_ms=1000.0, **big),
        _row("none", 1, prefilled_tokens=5065, turn_ms=998.0, prompt_tokens=26129),
        _row("reprefill", 0, prefilled_tokens=4105, turn_ms=440.0, **big),
        _row("reprefill", 1, prefilled_tokens=12940, edited=True, turn_ms=2070.0,
             prompt_tokens=6084),
        _row("splice", 0, prefilled_tokens=4105, turn_ms=440.0, **big),
        _row("splice", 1, prefilled_tokens=6140, edited=True, spliced=True, turn_ms=1400.0,
             splice_ms=18.0, ttft_ms=900.0, prompt_tokens=6084, first_token=3,
             reference_token=3, argmax_agree=True, reference_margin=0.002),
    ]  # fmt: skip


def _render(summary: dict, spec: ReplaySpec, wide: bool = False, width: int = 80) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=width, force_terminal=False).print(table(summary, spec, wide=wide))
    return out.getvalue().splitlines()


@pytest.mark.parametrize("levels", [[1], [1, 8]], ids=["one level", "two levels"])
def test_the_table_fits_80_columns_with_arm_names_and_numbers_whole(levels: list[int]) -> None:
    spec = ReplaySpec(traces=["x"], concurrency=levels)
    summary = summarize([LevelResult(lv, _readme_rows(), 1.0) for lv in levels], spec.arms)
    lines = _render(summary, spec)
    assert max(len(line) for line in lines) <= 80
    body = "\n".join(lines)
    assert "…" not in body
    for arm, prefilled in (("none", "10,065"), ("reprefill", "17,045"), ("splice", "10,245")):
        rows = [ln.split() for ln in lines if prefilled in ln]
        assert len(rows) == len(levels) and all(arm in r for r in rows), (arm, rows)
        assert all((r[-1] == "flat") == (arm == "splice") for r in rows), rows
    assert "56,129" in body and "1.69x" in body
    wide = _render(summary, spec, wide=True, width=170)  # every column, on 170
    assert max(len(line) for line in wide) <= 170 and "…" not in "\n".join(wide)
    header = " ".join(next(ln for ln in wide if "prefilled" in ln).split())
    assert header.endswith(
        "arm prefilled vs none prompt turns edited hit best turn ms edited ms ttft ms splice ms "
        "argmax skipped"
    )


def test_the_result_in_words_and_the_edited_turn_ratio() -> None:
    spec = ReplaySpec(traces=["x"])
    summary = summarize([LevelResult(1, _readme_rows(), 1.0)], spec.arms)
    level = summary["1"]
    assert level["splice_vs_reprefill_edited_latency"] == pytest.approx(1400 / 2070)
    assert level["splice_vs_reprefill_latency"] == pytest.approx(1840 / 2510)
    words = " ".join(in_words(level))
    assert "cost a re-prefill 6,980 extra prefilled tokens over none" in words
    assert "with splices they cost 180." in words
    assert "prefilled 6,140 tokens against 12,940" in words
    assert "took 1.40 s against 2.07 s re-prefilled (0.68x" in words
    assert "1 splice calls included: 18 ms each" in words
    doc = headline(summary, spec, None)
    assert doc["splice_vs_reprefill_edited_latency"] == pytest.approx(1400 / 2070)
    assert in_words({"arms": {"none": level["arms"]["none"]}}) == []


def test_the_ttft_column_includes_the_splice_call() -> None:
    t = arm_totals(_readme_rows()[4:])
    assert t["mean_ttft_ms"] == 900.0 and t["mean_ttft_with_splice_ms"] == 918.0


def test_argmax_is_not_applicable_on_flat_logits() -> None:
    """Flat: the reference's top two log-probabilities less than FLAT_MARGIN nats apart."""
    flat = dict(spliced=True, first_token=3, reference_token=3, argmax_agree=True)
    rows = [_row("splice", i, reference_margin=FLAT_MARGIN / 2, **flat) for i in range(4)]
    t = arm_totals(rows)
    assert (t["argmax_turns"], t["argmax_flat_turns"], t["argmax_decided_turns"]) == (4, 4, 0)
    assert t["argmax_agreement"] is None and argmax_cell(t) == "n/a flat"
    decided = dict(flat, reference_margin=FLAT_MARGIN * 3)
    wrong = dict(decided, first_token=4, argmax_agree=False)
    t = arm_totals([*rows, _row("splice", 4, **decided), _row("splice", 5, **wrong)])
    assert t["argmax_agreement"] == 0.5 and argmax_cell(t) == "50% of 2"
    assert argmax_cell(arm_totals([_row("none", 0)])) == "-"


def test_top_margin_reads_sglangs_top_logprobs() -> None:
    meta = {"output_top_logprobs": [[[-1.25, 7, None], [-1.75, 9, None]]]}
    assert top_margin(meta) == pytest.approx(0.5)
    assert top_margin({}) is None and top_margin({"output_top_logprobs": [[]]}) is None
