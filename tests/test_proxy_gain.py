"""The proxy shows its own gain: per turn and in totals, the tokens a re-prefill would have
prefilled (``reprefill_tokens``), those prefilled, those saved and the splice time, in
``/leyline/sessions`` and ``/metrics``; checked against a real re-prefill of the same turns
(a ``splice=False`` proxy on the same server), through the real ``openai`` client."""

from __future__ import annotations

import httpx
import pytest
from test_proxy import (
    POLICY,
    agent_conversation,
    expected_plans,
    new_id,
    openai_client,
    run_turns,
    serve_proxy,
    session_detail,
)

from leyline_agent.accounting import SpliceOutcome, Totals, TurnRecord
from leyline_agent.proxy import SESSION_HEADER
from leyline_agent.token_changes import common_prefix
from leyline_agent.wire import SpliceResponse


def _metric(text: str, name: str) -> float:
    [line] = [x for x in text.splitlines() if x.startswith(name + " ") or x.startswith(name + "{")]
    return float(line.split()[-1])


def test_reprefill_and_saved_tokens_of_a_spliced_turn() -> None:
    """A spliced turn of 500 prompt tokens whose first 200 the backend held unchanged: a
    re-prefill prefills 300; the splice prefilled 4 replacement tokens and the request 20."""
    from leyline_agent.wrapper import TurnPlan

    plan = TurnPlan(messages=[], tokens=[0] * 500, spans=[], directives=[], tail=[0] * 20,
                    edits=[], fallback=False, base_len=480)  # fmt: skip
    answer = SpliceResponse(new_length=480, prefix_reused=200, prefilled=4, rotated=270,
                            in_place=True, elapsed_ms=10.0)  # fmt: skip
    outcome = SpliceOutcome(answer, ms=12.0, best_reused=476, held_prefix=200)
    r = TurnRecord.of(plan, outcome, turn=3, prompt_tokens=500, cached_tokens=484)
    assert (r.prefilled_tokens, r.reprefill_tokens, r.saved_tokens) == (20, 300, 280)
    # no splice ran: the turn was the re-prefill
    r2 = TurnRecord.of(plan, SpliceOutcome(), turn=4, prompt_tokens=500, cached_tokens=200)
    assert (r2.prefilled_tokens, r2.reprefill_tokens, r2.saved_tokens) == (300, 300, 0)
    t = Totals.of([r, r2])
    assert (t.reprefill_tokens, t.prefilled_tokens, t.saved_tokens) == (600, 320, 280)


@pytest.mark.sglang
def test_sessions_and_metrics_show_what_splices_saved(leyline_server: str) -> None:
    """Per turn, ``reprefill_tokens`` of the splice session equals what a real re-prefill
    session (same server, same turns, ``splice=False``) prefilled; unspliced turns save 0."""
    turns = agent_conversation()
    sid, rid = new_id("gain"), new_id("gain-reprefill")
    with serve_proxy(leyline_server, POLICY) as proxy:
        run_turns(openai_client(proxy, **{SESSION_HEADER: sid}), turns)
        detail = session_detail(proxy, sid)
        listing = httpx.get(proxy + "/leyline/sessions", timeout=10).json()
        [summary] = [s for s in listing["sessions"] if s["id"] == sid]
        text = httpx.get(proxy + "/metrics", timeout=10).text
    with serve_proxy(leyline_server, POLICY, splice=False) as proxy:
        run_turns(openai_client(proxy, **{SESSION_HEADER: rid}), turns)
        baseline = session_detail(proxy, rid)["records"]

    plans = expected_plans(POLICY, turns)
    records = detail["records"]
    assert [r["spliced"] for r in records] == [bool(p.directives) for p in plans]
    assert sum(r["spliced"] for r in records) == 3
    for t, (rec, base, plan) in enumerate(zip(records, baseline, plans, strict=True)):
        assert rec["prompt_tokens"] == base["prompt_tokens"] == len(plan.tokens)
        if rec["spliced"]:
            held = common_prefix(plans[t - 1].tokens, plan.tokens)
            assert rec["reprefill_tokens"] == len(plan.tokens) - held, t
            assert rec["reprefill_tokens"] == base["prefilled_tokens"], t  # a real re-prefill
            assert rec["prefilled_tokens"] == len(plan.tail) + sum(
                len(d.replacement) for d in plan.directives
            )
            assert rec["saved_tokens"] == rec["reprefill_tokens"] - rec["prefilled_tokens"] > 100
            assert rec["splice_ms"] > 0
        else:
            assert rec["reprefill_tokens"] == rec["prefilled_tokens"] and rec["saved_tokens"] == 0
    for key in ("reprefill_tokens", "prefilled_tokens", "saved_tokens", "splice_ms"):
        assert summary[key] == pytest.approx(sum(r[key] for r in records)), key
    assert summary["saved_tokens"] == summary["reprefill_tokens"] - summary["prefilled_tokens"]
    assert summary["saved_tokens"] > 300
    label = f'{{session="{sid}"}}'
    assert (
        _metric(text, f"leyline_proxy_session_saved_tokens_total{label}")
        == (summary["saved_tokens"])
    )
    assert (
        _metric(text, f"leyline_proxy_session_reprefill_tokens_total{label}")
        == (summary["reprefill_tokens"])
    )
    assert _metric(text, f"leyline_proxy_session_splice_seconds_total{label}") == pytest.approx(
        summary["splice_ms"] / 1e3
    )
    assert _metric(text, "leyline_proxy_saved_tokens_total") >= summary["saved_tokens"]
    assert "the prompt minus the longest prefix of it that the backend held unchanged" in text
    assert "prompt minus the longest prefix" in listing["notes"]["saved_tokens"]
    assert "not cache lost" in listing["notes"]["best_hit_rate"]
    assert summary["shared_turns"] == 0  # serve_proxy: share_exact off, own namespace throughout
