"""The trace bench's rows read back (``cases.jsonl``, also of an interrupted run): the table,
agreement by the full context's top-1 margin, the cases where the edit changed the answer, the
same table over distinct cases only, and each AMORTIZE first-token miss explained (the margin,
the three paths' first tokens, what the removed spans held).

``python -m leyline_agent.bench.fidelity.misses OUT [OUT ...] --model smollm2-135m-instruct
--traces ... --budget 512 --cap-chars 300 ...`` (several OUT: their rows pooled, a case met twice
kept once; the runs' trace options, all of them, rebuild the cases to decode the removed spans).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
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


def key(r: dict[str, Any]) -> tuple[str, int, str, int]:
    """A row's case: (trace, turn, policy, cap)."""
    return (r["trace"], r["turn"], r["policy"], r.get("cap", 1200))


def read_rows(outs: Sequence[Path]) -> list[dict[str, Any]]:
    """The rows of each run's ``cases.jsonl``, in order; a case met again is dropped."""
    rows: dict[tuple[str, int, str, int], dict[str, Any]] = {}
    for out in outs:
        for line in (out / "cases.jsonl").read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                rows.setdefault(key(r), r)
    return list(rows.values())


def distinct(rows: list[dict[str, Any]], cases: list[tf.Case]) -> list[dict[str, Any]]:
    """The rows whose (full, edited) token pair no earlier row had (traces of one task in several
    agent configs can fit to the same window; one turn at two caps that cut nothing). A row whose
    case is not in ``cases`` is kept."""
    index = {(c.trace, c.turn, c.policy, c.cap): c for c in cases}
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    out = []
    for r in rows:
        c = index.get(key(r))
        pair = (tuple(c.full), tuple(c.edited)) if c else None
        if pair is None or pair not in seen:
            out.append(r)
        if pair is not None:
            seen.add(pair)
    return out


def changed(rows: list[dict[str, Any]]) -> str:
    """Where the edit changed the answer (the fresh prefill's first token is not the full
    context's): in how many AMORTIZE kept the full context's token, FORGET followed the fresh
    prefill's."""
    rs = [r for r in rows if r["fresh"][:1] != r["full"][:1]]
    kept = sum(r["amortize"][:1] == r["full"][:1] for r in rs)
    followed = sum(r["forget"][:1] == r["fresh"][:1] for r in rs)
    return (
        f"edit changed the first token (fresh != full): {len(rs)} of {len(rows)}; AMORTIZE kept "
        f"the full context's in {kept}, FORGET followed the fresh prefill in {followed}"
    )


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
    ap.add_argument("out", type=Path, nargs="+")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--traces", type=Path, action="append", default=[])
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--cap-chars", type=int, action="append", default=[])
    a = ap.parse_args()
    rows = read_rows(a.out)
    print(tf.table(tf.summarize(rows)))
    print()
    print(tf.policy_table(rows))
    print()
    print(by_margin(rows))
    print()
    print(changed(rows))
    renderer = load_renderer(served_model(a.model, None))
    loaded = [t for p in a.traces for t in load(p) if t.turns]
    spec = replace(tf.TraceFidelitySpec(), budget=a.budget, n=10**9)
    cases = [
        c
        for cap in a.cap_chars or [1200]
        for c in tf.cases(loaded, renderer, replace(spec, cap_chars=cap))
    ]
    uniq = distinct(rows, cases)
    print(f"\ndistinct (full, edited) token pairs: {len(uniq)} of {len(rows)} rows")
    print(tf.table(tf.summarize(uniq)))
    print()
    for m in explain(rows, cases, renderer.decode):
        print(json.dumps(m, ensure_ascii=False))


if __name__ == "__main__":
    main()
