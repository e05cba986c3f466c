"""The trace bench's rows read back (``cases.jsonl``, also of an interrupted run): the table,
agreement by the full context's top-1 margin, and each AMORTIZE first-token miss explained (the
margin, the three paths' first tokens, what the removed spans held).

``python -m leyline_agent.bench.fidelity.misses OUT --model smollm2-135m-instruct --traces ...
--budget 512 --cap-chars 300 ...`` (the run's own trace options rebuild the cases to decode the
removed spans).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from leyline_agent.bench.fidelity import traces as tf


def by_margin(rows: list[dict[str, Any]], edges: tuple[float, ...] = (0.5, 1.0, 2.0)) -> str:
    """AMORTIZE's and FORGET's first-token agreement with the full context per margin band."""
    lines = [
        "| full top-1 margin (nats) | n | AMORTIZE = full | FORGET = full |",
        "|---|---|---|---|",
    ]
    bounds = (0.0, *edges, float("inf"))
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        rs = [r for r in rows if r["margin"] is not None and lo <= r["margin"] < hi]
        if not rs:
            continue
        cells = []
        for key in ("amortize", "forget"):
            k = sum(1 for r in rs if r[key][:1] == r["full"][:1])
            a, b = tf.wilson(k, len(rs))
            cells.append(f"{k}/{len(rs)} ({a:.0%}–{b:.0%})")
        lines.append(f"| [{lo}, {hi}) | {len(rs)} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def explain(rows: list[dict[str, Any]], cases: list[tf.Case], decode: Any) -> list[dict[str, Any]]:
    """One dict per AMORTIZE first-token miss: margin, tokens, removed text (first 160 chars)."""
    index = {(c.trace, c.turn, c.policy, c.cap): c for c in cases}
    out = []
    for r in rows:
        if r["amortize"][:1] == r["full"][:1]:
            continue
        c = index.get((r["trace"], r["turn"], r["policy"], r.get("cap", 1200)))
        removed = " | ".join(decode(c.full[d.start : d.end]) for d in c.directives) if c else "?"
        out.append({
            "case": f"{r['trace']} turn {r['turn']} {r['policy'].split(':')[-1]} cap {r.get('cap')}",
            "margin": round(r["margin"], 3), "removed_tokens": r["removed"],
            "full": decode(r["full"][:1]), "amortize": decode(r["amortize"][:1]),
            "forget": decode(r["forget"][:1]), "kl_amortize": round(r["kl_amortize"], 3),
            "removed_text": removed.replace("\n", "⏎")[:160],
        })  # fmt: skip
    return out


def main() -> None:
    from leyline_agent.chat.model_dir import load_renderer
    from leyline_agent.commands.options import served_model
    from leyline_agent.traces import load

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--traces", type=Path, action="append", default=[])
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--cap-chars", type=int, action="append", default=[])
    a = ap.parse_args()
    lines = (a.out / "cases.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines if x.strip()]
    print(tf.table(tf.summarize(rows)))
    print()
    print(by_margin(rows))
    renderer = load_renderer(served_model(a.model, None))
    loaded = [t for p in a.traces for t in load(p) if t.turns]
    spec = replace(tf.TraceFidelitySpec(), budget=a.budget, n=10**9)
    cases = [
        c
        for cap in a.cap_chars or [1200]
        for c in tf.cases(loaded, renderer, replace(spec, cap_chars=cap))
    ]
    print()
    for m in explain(rows, cases, renderer.decode):
        print(json.dumps(m, ensure_ascii=False))


if __name__ == "__main__":
    main()
