"""The PNG plots of a replay (``plot``); the figures it reads are ``report.summarize``'s."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from leyline_agent import outputs
from leyline_agent.replay.runner import LevelResult
from leyline_agent.replay.spec import ReplaySpec, TurnRow


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
    from matplotlib.ticker import MaxNLocator

    plt = outputs.pyplot()

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
    paths.append(outputs.save_figure(fig, out / "prefilled.png"))

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
        paths.append(outputs.save_figure(fig, out / "prefilled_turns.png"))

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
    paths.append(outputs.save_figure(fig, out / "hit_rate.png"))

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
    paths.append(outputs.save_figure(fig, out / "latency.png"))
    return paths
