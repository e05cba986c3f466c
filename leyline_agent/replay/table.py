"""What ``leyline replay`` prints: the table (``table``) and its result in words (``in_words``).

The default table fits 80 columns (checked in a terminal: tests/test_replay.py renders it at
80); ``wide=True`` adds every other figure (``results.json`` holds them all). Its ``turn ms`` is
end to end as the agent waits (splice call + request), and so is ``ttft ms`` (splice call +
the server's time to first token).
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table

from leyline_agent.replay.spec import ReplaySpec

HIT_NOTE = (
    "hit: reused / prompt tokens (an arm that edits sends shorter prompts, so its hit rate can "
    "look lower than none's while it prefills as little: read prefilled first)"
)
BEST_NOTE = "best: the most a prefix cache could reuse in the session's own namespace"
TIME_NOTE = "ms: as the agent waits, splice calls included"
ARGMAX_NOTE = (
    "argmax: the splice arm's first token as an exact re-prefill's, on turns whose logits are "
    "not flat"
)


def _skipped(a: dict[str, Any]) -> str:
    if not a["skipped_turns"]:
        return "0"
    why = ", ".join(f"{n} {k}" for k, n in a["skip_reasons"].items())
    return f"{a['skipped_turns']} ({why})"


def argmax_cell(a: dict[str, Any]) -> str:
    """``"100% of 18"``; ``"n/a flat"`` when every checked turn's logits were flat
    (``report.FLAT_MARGIN``); ``"-"`` when none was checked."""
    if a["argmax_agreement"] is not None:
        return f"{a['argmax_agreement']:.0%} of {a['argmax_decided_turns']}"
    return "n/a flat" if a["argmax_turns"] else "-"


def table(summary: dict[str, Any], spec: ReplaySpec, *, wide: bool = False) -> Table:
    """Prefilled tokens first (the figure that carries over to GPUs), then hit rate, latency.

    Default columns: level (only with several), arm, prefilled, vs none, prompt, hit, turn ms,
    argmax, skipped (only when a turn was skipped). ``wide``: also turns, edited, best, edited
    ms, ttft ms, splice ms and skipped always.
    """
    levels = len(summary) > 1
    any_skipped = any(a["skipped_turns"] for s in summary.values() for a in s["arms"].values())
    notes = [HIT_NOTE, TIME_NOTE, ARGMAX_NOTE] + ([BEST_NOTE] if wide else [])
    t = Table(
        title=f"leyline replay (policy {spec.policy})",
        caption="; ".join(notes) + ".",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )
    if levels:
        t.add_column("conc", justify="right", no_wrap=True)
    t.add_column("arm", no_wrap=True)
    cols = ["prefilled", "vs none", "prompt"]
    cols += ["turns", "edited", "hit", "best"] if wide else ["hit"]
    cols += ["turn ms"] + (["edited ms", "ttft ms", "splice ms"] if wide else []) + ["argmax"]
    for col in cols:
        t.add_column(col, justify="right", no_wrap=True)
    if wide or any_skipped:
        t.add_column("skipped", justify="right")
    for lv, s in summary.items():
        base = s["arms"].get("none", {}).get("prefilled_tokens")
        for i, (arm, a) in enumerate(s["arms"].items()):
            cells = [lv if i == 0 else ""] if levels else []
            cells += [arm, f"{a['prefilled_tokens']:,}"]
            cells.append(f"{a['prefilled_tokens'] / base:.2f}x" if base else "-")
            cells.append(f"{a['prompt_tokens']:,}")
            if wide:
                cells += [str(a["turns"]), str(a["edited_turns"])]
            cells.append(f"{a['hit_rate']:.1%}")
            if wide:
                cells.append(f"{a['best_hit_rate']:.1%}")
            cells.append(f"{a['mean_turn_ms']:.0f}")
            if wide:
                cells.append(f"{a['mean_edited_turn_ms']:.0f}" if a["edited_turns"] else "-")
                cells.append(f"{a['mean_ttft_with_splice_ms']:.0f}")
                cells.append(f"{a['mean_splice_ms']:.0f}" if a["spliced_turns"] else "-")
            cells.append(argmax_cell(a))
            if wide or any_skipped:
                cells.append(_skipped(a))
            t.add_row(*cells, end_section=i == len(s["arms"]) - 1)
    return t


def in_words(level: dict[str, Any]) -> list[str]:
    """One level's result in sentences: what the policy's edits cost a re-prefill and a splice
    (prefilled tokens over ``none``), and on the edited turns the tokens and time of the splice
    arm against the re-prefill arm (their ratio: ``splice_vs_reprefill_edited_latency``).
    Empty when the level lacks the arms compared."""
    arms = level["arms"]
    out: list[str] = []
    if "reprefill" in arms and "splice" in arms:
        r, s = arms["reprefill"], arms["splice"]
        if "none" in arms:
            base = arms["none"]["prefilled_tokens"]
            out.append(
                f"The policy's edits cost a re-prefill {r['prefilled_tokens'] - base:,} extra "
                f"prefilled tokens over none; with splices they cost "
                f"{s['prefilled_tokens'] - base:,}."
            )
        ratio = level.get("splice_vs_reprefill_edited_latency")
        if s["edited_turns"] and ratio is not None:
            out.append(
                f"On the {s['edited_turns']} edited turns the splice arm prefilled "
                f"{s['edited_prefilled_tokens']:,} tokens against {r['edited_prefilled_tokens']:,}"
                f" and took {s['edited_turn_ms'] / 1e3:.2f} s against "
                f"{r['edited_turn_ms'] / 1e3:.2f} s re-prefilled ({ratio:.2f}x, its "
                f"{s['spliced_turns']} splice calls included: {s['mean_splice_ms']:.0f} ms each)."
            )
    return out
