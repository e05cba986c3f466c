"""Totals, the last stdout line and ``results.json`` of a replay (the table: ``table.py``; the
plots: ``plots.py``).

Per arm, summed over the traces and turns of one concurrency level that ran (skipped turns are
counted in ``skipped_turns``/``skip_reasons`` only): the ``accounting.Totals`` of the turns
(``prompt_tokens``, ``prefilled_tokens``, ``reused_tokens``, ``server_cached_tokens``,
``best_reused_tokens``, ``hit_rate``, ``best_hit_rate``, ...; defined in ``accounting.py``), and:

- ``mean_turn_ms``: splice + request time per turn; ``edited_turn_ms``: its sum over the edited
  turns; ``mean_ttft_ms``: the server's time to first token; ``mean_ttft_with_splice_ms``: the
  splice call plus that (what the agent waits for a first token);
- ``argmax_agreement``: fraction of the decided spliced turns whose first token equals the exact
  reference path's (``runner.py``); a checked turn is decided when the reference's top two
  log-probabilities differ by at least ``FLAT_MARGIN`` (else its logits are flat: the argmax is a
  tie that rounding breaks, and agreement on it says nothing); None when none was decided.
  ``argmax_turns``: turns checked, ``argmax_flat_turns``: those with flat logits.

Per level, ``splice_vs_reprefill_latency`` (mean turn time, all turns) and
``splice_vs_reprefill_edited_latency`` (time summed over the edited turns, the same turns in
both arms): the splice arm's over the re-prefill arm's.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from leyline_agent import outputs
from leyline_agent.accounting import Totals
from leyline_agent.arms import Arm
from leyline_agent.replay.runner import LevelResult
from leyline_agent.replay.spec import ReplaySpec, TurnRow

HIT_RATE_NOTE = (
    "read prefilled tokens first: hit rate is reused / prompt, and an edited (shorter) prompt has "
    "a smaller denominator, so an arm that edits can show a lower hit rate than `none` while "
    "prefilling the same number of tokens"
)
AGREEMENT_NOTE = (
    "argmax agreement compares the splice arm's first token with an exact (re-prefilled) path on "
    "the same tokens, over the turns whose logits are not flat (top two log-probabilities at "
    "least FLAT_MARGIN apart); with the embedded model's random weights they are flat: n/a"
)
# Nats between the reference path's top two log-probabilities below which its argmax is a tie
# that bf16 rounding on either path may break either way: agreement on it says nothing. The
# embedded model's random weights give exactly 0.0 on every turn (its top two logits are equal).
FLAT_MARGIN = 0.01


def _mean(xs: Sequence[float]) -> float:
    return float(statistics.fmean(xs)) if xs else 0.0


def _quantile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return float(s[min(len(s) - 1, round(q * (len(s) - 1)))])


def arm_totals(rows: Sequence[TurnRow]) -> dict[str, Any]:
    """Totals of one arm at one level (see the module docstring)."""
    done = [r for r in rows if r.error is None]
    reasons = Counter(r.skip_reason or "error" for r in rows if r.error is not None)
    turn_ms = [r.turn_ms for r in done]
    checked = [r for r in done if r.argmax_agree is not None]
    decided = [
        r for r in checked if r.reference_margin is None or r.reference_margin >= FLAT_MARGIN
    ]
    ttft = [r.splice_ms + r.ttft_ms for r in done if r.ttft_ms is not None]
    return {
        **Totals.of(done).as_dict(),
        "skipped_turns": len(rows) - len(done),
        "skip_reasons": dict(reasons),
        "mean_turn_ms": _mean(turn_ms),
        "p50_turn_ms": _quantile(turn_ms, 0.5),
        "p90_turn_ms": _quantile(turn_ms, 0.9),
        "mean_edited_turn_ms": _mean([r.turn_ms for r in done if r.edited]),
        "edited_turn_ms": sum(r.turn_ms for r in done if r.edited),
        "mean_ttft_ms": _mean([r.ttft_ms for r in done if r.ttft_ms is not None]),
        "mean_ttft_with_splice_ms": _mean(ttft),
        "mean_splice_ms": _mean([r.splice_ms for r in done if r.spliced]),
        "argmax_turns": len(checked),
        "argmax_flat_turns": len(checked) - len(decided),
        "argmax_decided_turns": len(decided),
        "argmax_distinct_tokens": len({r.reference_token for r in checked}),
        "argmax_agreement": (
            sum(bool(r.argmax_agree) for r in decided) / len(decided) if decided else None
        ),
    }


def summarize(levels: Sequence[LevelResult], arms: Sequence[Arm]) -> dict[str, Any]:
    """``{"<level>": {"wall_s", "splice_vs_reprefill_latency",
    "splice_vs_reprefill_edited_latency", "arms": {arm: totals}}}``."""
    out: dict[str, Any] = {}
    for lv in levels:
        per_arm = {a: arm_totals([r for r in lv.rows if r.arm == a]) for a in arms}
        ratio = edited = None
        if "splice" in per_arm and "reprefill" in per_arm:
            s, r = per_arm["splice"], per_arm["reprefill"]
            ratio = s["mean_turn_ms"] / r["mean_turn_ms"] if r["mean_turn_ms"] else None
            edited = s["edited_turn_ms"] / r["edited_turn_ms"] if r["edited_turn_ms"] else None
        out[str(lv.level)] = {
            "wall_s": lv.wall_s,
            "sessions": len({(r.trace, r.arm) for r in lv.rows}),
            "splice_vs_reprefill_latency": ratio,
            "splice_vs_reprefill_edited_latency": edited,
            "arms": per_arm,
        }
    return out


_HEADLINE = (
    "prefilled_tokens",
    "prompt_tokens",
    "reused_tokens",
    "hit_rate",
    "best_hit_rate",
    "mean_turn_ms",
    "skipped_turns",
    "argmax_agreement",
    "saved_tokens",
)


def headline(summary: dict[str, Any], spec: ReplaySpec, results: Path | None) -> dict[str, Any]:
    """The last stdout line: the first level's arms in full, every level's key figures."""
    first = summary[str(spec.concurrency[0])]
    return {
        "concurrency": spec.concurrency[0],
        "arms": first["arms"],
        "splice_vs_reprefill_latency": first["splice_vs_reprefill_latency"],
        "splice_vs_reprefill_edited_latency": first["splice_vs_reprefill_edited_latency"],
        "levels": {
            lv: {
                "splice_vs_reprefill_latency": s["splice_vs_reprefill_latency"],
                "splice_vs_reprefill_edited_latency": s["splice_vs_reprefill_edited_latency"],
                "arms": {a: {k: t[k] for k in _HEADLINE} for a, t in s["arms"].items()},
            }
            for lv, s in summary.items()
        },
        "policy": spec.policy,
        "results": str(results) if results else None,
        "note": AGREEMENT_NOTE,
        "hit_rate_note": HIT_RATE_NOTE,
    }


def write_results(
    out: Path,
    spec: ReplaySpec,
    summary: dict[str, Any],
    levels: Sequence[LevelResult],
    traces: Sequence[dict[str, Any]],
    env: dict[str, Any],
) -> Path:
    """``out/results.json``: arguments, environment, per-level totals, every turn."""
    return outputs.write_results(
        out,
        spec,
        env,
        note=AGREEMENT_NOTE,
        hit_rate_note=HIT_RATE_NOTE,
        traces=list(traces),
        levels=summary,
        turns=[r.model_dump(mode="json") for lv in levels for r in lv.rows],
    )
