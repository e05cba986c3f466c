"""Totals, the terminal table and ``results.json`` of a replay (the plots: ``plots.py``).

Per arm, summed over the traces and turns of one concurrency level that ran (skipped turns are
counted in ``skipped_turns``/``skip_reasons`` only): the ``accounting.Totals`` of the turns
(``prompt_tokens``, ``prefilled_tokens``, ``reused_tokens``, ``server_cached_tokens``,
``best_reused_tokens``, ``hit_rate``, ``best_hit_rate``, ...; defined in ``accounting.py``), and:

- ``mean_turn_ms``: splice + request time per turn; ``mean_ttft_ms``: the server's time to first
  token; ``argmax_agreement``: fraction of spliced turns whose first token equals the exact
  reference path's (``runner.py``).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

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
    "the same tokens; with the embedded model's random weights it is a mechanics figure, not "
    "output quality (its logits are nearly flat: see argmax_distinct_tokens)"
)


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
    return {
        **Totals.of(done).as_dict(),
        "skipped_turns": len(rows) - len(done),
        "skip_reasons": dict(reasons),
        "mean_turn_ms": _mean(turn_ms),
        "p50_turn_ms": _quantile(turn_ms, 0.5),
        "p90_turn_ms": _quantile(turn_ms, 0.9),
        "mean_edited_turn_ms": _mean([r.turn_ms for r in done if r.edited]),
        "mean_ttft_ms": _mean([r.ttft_ms for r in done if r.ttft_ms is not None]),
        "mean_splice_ms": _mean([r.splice_ms for r in done if r.spliced]),
        "argmax_turns": len(checked),
        "argmax_distinct_tokens": len({r.reference_token for r in checked}),
        "argmax_agreement": (
            sum(bool(r.argmax_agree) for r in checked) / len(checked) if checked else None
        ),
    }


def summarize(levels: Sequence[LevelResult], arms: Sequence[Arm]) -> dict[str, Any]:
    """``{"<level>": {"wall_s", "splice_vs_reprefill_latency", "arms": {arm: totals}}}``."""
    out: dict[str, Any] = {}
    for lv in levels:
        per_arm = {a: arm_totals([r for r in lv.rows if r.arm == a]) for a in arms}
        ratio = None
        if "splice" in per_arm and "reprefill" in per_arm:
            base = per_arm["reprefill"]["mean_turn_ms"]
            ratio = per_arm["splice"]["mean_turn_ms"] / base if base else None
        out[str(lv.level)] = {
            "wall_s": lv.wall_s,
            "sessions": len({(r.trace, r.arm) for r in lv.rows}),
            "splice_vs_reprefill_latency": ratio,
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
)


def headline(summary: dict[str, Any], spec: ReplaySpec, results: Path | None) -> dict[str, Any]:
    """The last stdout line: the first level's arms in full, every level's key figures."""
    first = summary[str(spec.concurrency[0])]
    return {
        "concurrency": spec.concurrency[0],
        "arms": first["arms"],
        "splice_vs_reprefill_latency": first["splice_vs_reprefill_latency"],
        "levels": {
            lv: {
                "splice_vs_reprefill_latency": s["splice_vs_reprefill_latency"],
                "arms": {a: {k: t[k] for k in _HEADLINE} for a, t in s["arms"].items()},
            }
            for lv, s in summary.items()
        },
        "policy": spec.policy,
        "results": str(results) if results else None,
        "note": AGREEMENT_NOTE,
        "hit_rate_note": HIT_RATE_NOTE,
    }


def _skipped(a: dict[str, Any]) -> str:
    if not a["skipped_turns"]:
        return "0"
    why = ", ".join(f"{n} {k}" for k, n in a["skip_reasons"].items())
    return f"{a['skipped_turns']} ({why})"


def table(summary: dict[str, Any], spec: ReplaySpec) -> Table:
    """Prefilled tokens first (the figure that carries over to GPUs), then hit rate, latency."""
    t = Table(
        title=f"leyline replay (policy {spec.policy})",
        caption=f"{HIT_RATE_NOTE}. {AGREEMENT_NOTE}",
    )
    t.add_column("conc", justify="right")
    t.add_column("arm")
    for col in ("prefilled", "vs none", "prompt", "turns", "edited", "skipped", "hit", "best"):
        t.add_column(col, justify="right", no_wrap=col != "skipped")
    for col in ("turn ms", "ttft ms", "splice ms", "argmax"):
        t.add_column(col, justify="right", no_wrap=True)
    for lv, s in summary.items():
        base = s["arms"].get("none", {}).get("prefilled_tokens")
        for i, (arm, a) in enumerate(s["arms"].items()):
            agree = a["argmax_agreement"]
            t.add_row(
                lv if i == 0 else "",
                arm,
                f"{a['prefilled_tokens']:,}",
                f"{a['prefilled_tokens'] / base:.2f}x" if base else "-",
                f"{a['prompt_tokens']:,}",
                str(a["turns"]),
                str(a["edited_turns"]),
                _skipped(a),
                f"{a['hit_rate']:.1%}",
                f"{a['best_hit_rate']:.1%}",
                f"{a['mean_turn_ms']:.0f}",
                f"{a['mean_ttft_ms']:.0f}",
                f"{a['mean_splice_ms']:.0f}" if a["spliced_turns"] else "-",
                f"{agree:.0%} of {a['argmax_turns']}" if agree is not None else "-",
                end_section=i == len(s["arms"]) - 1,
            )
    return t


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
