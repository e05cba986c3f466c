"""Totals, the terminal table, ``results.json`` and the plots of a replay.

Definitions (per arm, summed over traces and turns of one concurrency level):

- ``prompt_tokens``: tokens of the prompts sent.
- ``prefilled_tokens``: tokens run through the model: the request's uncached part plus what the
  splice prefilled (replacements; for FORGET everything after the edit).
- ``cached_tokens``: ``prompt_tokens − prefilled_tokens``, the prompt tokens whose KV was reused
  instead of computed. (The server's own count, ``server_cached_tokens``, also counts the tokens a
  splice prefilled just before the request.)
- ``hit_rate = cached / prompt``; ``best_hit_rate = best_cached / prompt`` with the theoretical
  best of the arm (``SessionCore.best_cached``: only new and replacement tokens prefilled for
  ``splice``, the prefix before the first edit for ``reprefill``, the previous prompt for ``none``).
- ``mean_turn_ms``: splice + request time per turn; ``mean_ttft_ms``: the server's time to first
  token; ``argmax_agreement``: fraction of spliced turns whose first token equals the exact
  reference path's (``runner.py``).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from rich.table import Table

from leyline_agent.replay import Arm
from leyline_agent.replay.runner import LevelResult, ReplaySpec, TurnRow

HIT_RATE_NOTE = (
    "read prefilled tokens first: hit rate is cached / prompt, and an edited (shorter) prompt has "
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
    prompt = sum(r.prompt_tokens for r in done)
    prefilled = sum(r.prefilled_tokens for r in done)
    cached = sum(r.reused_tokens for r in done)
    best = sum(r.best_cached_tokens for r in done)
    reasons: dict[str, int] = {}
    for r in rows:
        if r.error is not None:
            key = r.skip_reason or "error"
            reasons[key] = reasons.get(key, 0) + 1
    turn_ms = [r.turn_ms for r in done]
    edited_ms = [r.turn_ms for r in done if r.edited]
    checked = [r for r in done if r.argmax_agree is not None]
    return {
        "turns": len(done),
        "skipped_turns": len(rows) - len(done),
        "skip_reasons": reasons,
        "edited_turns": sum(r.edited for r in done),
        "spliced_turns": sum(r.spliced for r in done),
        "splice_errors": sum(r.splice_error is not None for r in done),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefilled_tokens": prefilled,
        "server_cached_tokens": sum(r.cached_tokens for r in done),
        "best_cached_tokens": best,
        "splice_prefilled_tokens": sum(r.splice_prefilled for r in done),
        "rotated_tokens": sum(r.rotated_tokens for r in done),
        "hit_rate": cached / prompt if prompt else 0.0,
        "best_hit_rate": best / prompt if prompt else 0.0,
        "mean_turn_ms": _mean(turn_ms),
        "p50_turn_ms": _quantile(turn_ms, 0.5),
        "p90_turn_ms": _quantile(turn_ms, 0.9),
        "mean_edited_turn_ms": _mean(edited_ms),
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
    "cached_tokens",
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


def git_commit(start: Path | None = None) -> str | None:
    """The checkout's HEAD commit, read from ``.git`` (no git process); None outside a checkout."""
    here = (start or Path(__file__)).resolve()
    for d in (here, *here.parents):
        git = d / ".git"
        if git.is_file():  # worktree or submodule: "gitdir: <path>"
            git = (d / git.read_text().split(":", 1)[1].strip()).resolve()
        if not git.is_dir():
            continue
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head
        ref = head.split(":", 1)[1].strip()
        common = git / "commondir"
        roots = [git] + ([(git / common.read_text().strip()).resolve()] if common.is_file() else [])
        for root in roots:
            if (root / ref).is_file():
                return (root / ref).read_text().strip()
            packed = root / "packed-refs"
            if packed.is_file():
                for line in packed.read_text().splitlines():
                    if line.endswith(" " + ref):
                        return line.split()[0]
        return None
    return None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment(backend_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """Machine, versions and commit, recorded beside the figures."""
    return {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
        },
        "versions": {
            d: _version(d)
            for d in ("leyline-agent", "sglang", "torch", "httpx", "pydantic", "tokenizers")
        },
        "commit": git_commit(),
        "argv": sys.argv,
        "backend": backend_info,
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
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "arguments": spec.model_dump(mode="json"),
        "environment": env,
        "note": AGREEMENT_NOTE,
        "hit_rate_note": HIT_RATE_NOTE,
        "traces": list(traces),
        "levels": summary,
        "turns": [r.model_dump(mode="json") for lv in levels for r in lv.rows],
    }
    path = out / "results.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def _turn(row: TurnRow) -> int:
    return row.turn


def _short(text: str, n: int = 34) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def plot(
    out: Path,
    summary: dict[str, Any],
    spec: ReplaySpec,
    levels_rows: Sequence[LevelResult] = (),
) -> list[Path]:
    """``prefilled.png`` (tokens prefilled per arm, grouped by concurrency level),
    ``prefilled_turns.png`` (tokens prefilled per turn along each trace, first level; only with
    ``levels_rows``), ``hit_rate.png`` (measured bars, theoretical best as outlines) and
    ``latency.png`` (mean turn time with p50–p90 whiskers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    levels = list(summary)
    arms = list(spec.arms)
    width = 0.8 / len(arms)
    colors = {"none": "#8c8c8c", "reprefill": "#d62728", "splice": "#1f77b4"}
    paths = []
    policy = _short(spec.policy, 48)

    fig, ax = plt.subplots(figsize=(max(4.8, 2.6 + 1.6 * len(levels)), 3.6))
    for k, arm in enumerate(arms):
        xs = [i + (k - (len(arms) - 1) / 2) * width for i in range(len(levels))]
        pre = [summary[lv]["arms"][arm]["prefilled_tokens"] for lv in levels]
        bars = ax.bar(xs, pre, width * 0.9, label=arm, color=colors.get(arm))
        ax.bar_label(bars, [f"{v:,}" for v in pre], fontsize=6, padding=1)
    ax.set_xticks(range(len(levels)), [f"c={lv}" for lv in levels])
    ax.set_ylabel("tokens prefilled (all turns)")
    ax.margins(y=0.15)
    ax.set_title(f"tokens prefilled per arm (lower is better)\n{policy}", fontsize=9)
    ax.legend(fontsize=8, loc="upper center", ncol=len(arms), frameon=False)
    fig.tight_layout()
    paths.append(out / "prefilled.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    if levels_rows:
        rows = list(levels_rows[0].rows)
        traces = list(dict.fromkeys(r.trace for r in rows))
        shown = traces[:6]
        ncol = min(3, len(shown))
        nrow = -(-len(shown) // ncol)
        fig, axes = plt.subplots(nrow, ncol, figsize=(3.4 * ncol, 2.6 * nrow + 0.5), squeeze=False)
        for ax, name in zip(axes.flat, shown, strict=False):
            for arm in arms:
                rs = sorted((r for r in rows if r.trace == name and r.arm == arm), key=_turn)
                ax.plot(
                    [r.turn for r in rs],
                    [r.prefilled_tokens for r in rs],
                    "o-", ms=3, lw=1.2, label=arm, color=colors.get(arm),
                )  # fmt: skip
                skipped = [r.turn for r in rs if r.error is not None]
                ax.plot(skipped, [0] * len(skipped), "x", color=colors.get(arm), ms=6)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_title(_short(name), fontsize=8)
            ax.set_xlabel("turn", fontsize=8)
            ax.tick_params(labelsize=7)
        for ax in axes.flat[len(shown) :]:
            ax.axis("off")
        axes[0][0].set_ylabel("tokens prefilled", fontsize=8)
        axes[0][0].legend(fontsize=7)
        more = f" (first {len(shown)} of {len(traces)} traces)" if len(traces) > len(shown) else ""
        fig.suptitle(
            f"tokens prefilled per turn, c={levels_rows[0].level}{more}; x: skipped turn",
            fontsize=9,
        )
        fig.tight_layout()
        paths.append(out / "prefilled_turns.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(4.8, 2.2 + 1.6 * len(levels)), 3.6))
    for k, arm in enumerate(arms):
        xs = [i + (k - (len(arms) - 1) / 2) * width for i in range(len(levels))]
        hit = [summary[lv]["arms"][arm]["hit_rate"] for lv in levels]
        best = [summary[lv]["arms"][arm]["best_hit_rate"] for lv in levels]
        ax.bar(xs, hit, width * 0.9, label=arm, color=colors.get(arm))
        ax.bar(xs, best, width * 0.9, fill=False, edgecolor="black", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(levels)), [f"c={lv}" for lv in levels])
    ax.set_ylabel("prompt tokens reused (hit rate)")
    ax.set_ylim(0, 1.18)
    ax.set_title(
        "cache hit rate per arm (dashed: theoretical best)\n"
        "an edited, shorter prompt lowers it at equal prefill",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper center", ncol=len(arms), frameon=False)
    fig.tight_layout()
    paths.append(out / "hit_rate.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(4.8, 2.2 + 1.6 * len(levels)), 3.6))
    for k, arm in enumerate(arms):
        xs = [i + (k - (len(arms) - 1) / 2) * width for i in range(len(levels))]
        a = [summary[lv]["arms"][arm] for lv in levels]
        mean = [t["mean_turn_ms"] for t in a]
        lo = [max(0.0, m - t["p50_turn_ms"]) for m, t in zip(mean, a, strict=True)]
        hi = [max(0.0, t["p90_turn_ms"] - m) for m, t in zip(mean, a, strict=True)]
        ax.bar(xs, mean, width * 0.9, label=arm, color=colors.get(arm), yerr=[lo, hi], capsize=3)
    ax.set_xticks(range(len(levels)), [f"c={lv}" for lv in levels])
    means = [summary[lv]["arms"][a]["mean_turn_ms"] for lv in levels for a in arms]
    if min(means) > 0 and max(means) / min(means) > 8:  # levels far apart: keep both readable
        ax.set_yscale("log")
    ax.set_ylabel("mean turn time, ms (whiskers: p50–p90)")
    ax.set_title("end-to-end turn latency per arm (splice + request)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "latency.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
