"""``leyline bench splice`` results: medians per length, the terminal table, ``results.json`` and
``splice.png``."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from leyline_agent.bench.splice.measure import SpliceBenchSpec, Trial
from leyline_agent.bench.splice.memory import MEMORY_NOTE
from leyline_agent.outputs import pyplot, save_figure
from leyline_agent.outputs import write_results as write_results_json


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def _peak(ts: Sequence[Trial], phase: str) -> int | None:
    vals = [t.memory.get(phase, {}).get("scheduler_hwm_kib") for t in ts]
    return max((v for v in vals if v), default=None)


def summarize(trials: Sequence[Trial], page: int = 1) -> dict[str, dict[str, Any]]:
    """``{str(L): medians}``; ``speedup = reprefill_ms / (splice_ms + next_ms)``; ``splice_hit``: the
    next request found every full ``page`` of the edited sequence cached; ``memory``:
    peak scheduler RSS per phase (max over repeats) and the last reading of each phase."""
    out: dict[str, dict[str, Any]] = {}
    for length in sorted({t.length for t in trials}):
        ts = [t for t in trials if t.length == length]
        keys = sorted({k for t in ts for k in t.timings_ms})
        total = _median([t.splice_total_ms for t in ts])
        reprefill = _median([t.reprefill_ms for t in ts])
        out[str(length)] = {
            "repeats": len(ts),
            "spliced_length": ts[0].spliced_length,
            "prefilled": ts[0].prefilled,
            "rotated": ts[0].rotated,
            "splice_ms": _median([t.splice_ms for t in ts]),
            "splice_server_ms": _median([t.splice_server_ms for t in ts]),
            "splice_timings_ms": {k: _median([t.timings_ms.get(k, 0.0) for t in ts]) for k in keys},
            "next_ms": _median([t.next_ms for t in ts]),
            "splice_total_ms": total,
            "reprefill_ms": reprefill,
            "speedup": reprefill / total if total else None,
            "next_prompt": ts[0].next_prompt,
            "next_cached": min(t.next_cached for t in ts),
            # a paged tree holds full pages only: a hit is every full page of the edit
            "splice_hit": all(t.next_cached == t.spliced_length // page * page for t in ts),
            "reprefill_cached": max(t.reprefill_cached for t in ts),
            "memory": {
                "splice_peak_kib": _peak(ts, "splice"),
                "reprefill_peak_kib": _peak(ts, "reprefill"),
                "last": ts[-1].memory,
            },
        }
    return out


def _mib(kib: int | None) -> str:
    return f"{kib / 1024:,.0f}" if kib else "-"


def table(summary: dict[str, dict[str, Any]], spec: SpliceBenchSpec) -> Table:
    edit = f"[{spec.edit_start}, {spec.edit_end}) -> {spec.replacement} tokens"
    t = Table(
        title=f"leyline bench splice (edit {edit}; medians of {spec.repeats})",
        caption="splice+next: the splice call and the request after it; re-prefill: the same "
        "request cold. " + MEMORY_NOTE,
    )
    for col in ("L", "splice ms", "prefill/rotate/tree", "next ms", "splice+next"):
        t.add_column(col, justify="right", no_wrap=True)
    for col in ("re-prefill ms", "speedup", "cached", "peak RSS MiB splice/re-prefill"):
        t.add_column(col, justify="right", no_wrap=True)
    for length, s in summary.items():
        tm = s["splice_timings_ms"]
        parts = "/".join(f"{tm[k]:.1f}" for k in ("prefill", "rotate", "tree") if k in tm)
        t.add_row(
            f"{int(length):,}",
            f"{s['splice_ms']:.1f}",
            parts or "-",
            f"{s['next_ms']:.1f}",
            f"{s['splice_total_ms']:.1f}",
            f"{s['reprefill_ms']:.1f}",
            f"{s['speedup']:.1f}x" if s["speedup"] else "-",
            f"{s['next_cached']:,}/{s['next_prompt']:,}",
            f"{_mib(s['memory']['splice_peak_kib'])}/{_mib(s['memory']['reprefill_peak_kib'])}",
        )
    return t


def plot(out: Path, summary: dict[str, dict[str, Any]], spec: SpliceBenchSpec) -> Path:
    """``out/splice.png``: latency against L (left), the splice broken down (right)."""
    from matplotlib.ticker import FuncFormatter

    plt = pyplot()
    lengths = [int(n) for n in summary]
    rows = list(summary.values())
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9.5, 3.8))
    ax.plot(lengths, [s["reprefill_ms"] for s in rows], "o-", color="#d62728", label="re-prefill")
    ax.plot(lengths, [s["splice_total_ms"] for s in rows], "o-", color="#1f77b4",
            label="splice + next request")  # fmt: skip
    ax.plot(lengths, [s["splice_ms"] for s in rows], "o--", color="#1f77b4", alpha=0.6,
            label="splice call alone")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.set_xticks(lengths, [f"{n // 1024}k" if n >= 1024 else str(n) for n in lengths])
    ax.set_xlabel("cached sequence length L (tokens)")
    ax.set_ylabel("median wall time, ms")
    ax.set_title("edit near the start: splice vs re-prefill", fontsize=9)
    ax.legend(fontsize=8)

    xs = range(len(lengths))
    keys = [
        k for k in ("prefill", "rotate", "tree") if any(k in s["splice_timings_ms"] for s in rows)
    ]
    bottom = [0.0] * len(rows)
    for k, color in zip(keys, ("#9ecae1", "#3182bd", "#08519c"), strict=False):
        vals = [s["splice_timings_ms"].get(k, 0.0) for s in rows]
        bx.bar(xs, vals, 0.6, bottom=bottom, label=k, color=color)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    rest = [max(0.0, s["splice_ms"] - b) for s, b in zip(rows, bottom, strict=True)]
    bx.bar(xs, rest, 0.6, bottom=bottom, label="HTTP + queue + other", color="#d9d9d9")
    bx.set_xticks(xs, [f"{n:,}" for n in lengths])
    bx.set_xlabel("L (tokens)")
    bx.set_ylabel("median splice call, ms")
    bx.set_title(f"splice call broken down ({spec.replacement}-token replacement)", fontsize=9)
    bx.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, out / "splice.png")


def write_results(
    out: Path,
    spec: SpliceBenchSpec,
    summary: dict[str, dict[str, Any]],
    trials: Sequence[Trial],
    env: dict[str, Any],
) -> Path:
    """``out/results.json``: arguments, environment, medians per length, every trial."""
    return write_results_json(
        out,
        spec,
        env,
        memory_note=MEMORY_NOTE,
        lengths=summary,
        trials=[t.model_dump(mode="json") for t in trials],
    )
