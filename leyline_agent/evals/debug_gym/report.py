"""Totals per arm, the terminal table, ``results.json``, the PNG plot and the headline JSON.

Per arm (summed over tasks): ``tasks``, ``resolved``, ``resolve_rate``, ``steps`` (model calls),
``tool_calls`` (calls of a tool the env has, executed), ``empty_tool_responses``, the
``accounting.Totals`` of the proxy's turns (``turns``: requests the proxy answered,
``edited_turns``, ``policy_edited_turns``, ``prompt_tokens``, ``reused_tokens``,
``prefilled_tokens``, the edited turns' ``edited_prompt_tokens``/``edited_prefilled_tokens``,
``hit_rate``, ...: see ``accounting.py``), ``wall_s`` and ``errors``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from leyline_agent.accounting import Totals
from leyline_agent.evals.debug_gym.runner import EvalRun
from leyline_agent.evals.debug_gym.spec import TaskResult

RANDOM_WEIGHTS_NOTE = (
    "the backend serves random weights (dummy load format): the agent cannot solve anything, so "
    "the figures measure the mechanics (tool outputs, policy edits, splices), not debugging skill"
)
CONSTRAINED_NOTE = (
    "tool calls were forced by constrained decoding (an EBNF grammar per request) to the "
    "read-only tools {tools}"
)
UNSANDBOXED_NOTE = (
    "tools ran unsandboxed on this host, each task in a throwaway copy under OUT/<arm>/workdirs"
)
_STEPS = ("steps", "tool_calls", "empty_tool_responses")
_TOTALS = (
    "turns",
    "edited_turns",
    "policy_edited_turns",
    "spliced_turns",
    "splice_misses",
    "prompt_tokens",
    "reused_tokens",
    "server_cached_tokens",
    "best_reused_tokens",
    "prefilled_tokens",
    "splice_prefilled_tokens",
    "edited_prompt_tokens",
    "edited_prefilled_tokens",
    "hit_rate",
    "best_hit_rate",
)


def arm_totals(rows: Sequence[TaskResult]) -> dict[str, Any]:
    """Totals of one arm (see the module docstring)."""
    out: dict[str, Any] = {"tasks": len(rows), "resolved": sum(r.resolved for r in rows)}
    out["resolve_rate"] = out["resolved"] / len(rows) if rows else 0.0
    for key in _STEPS:
        out[key] = sum(getattr(r, key) for r in rows)
    totals = Totals()
    for r in rows:
        totals.merge(r.totals)
    summed = totals.as_dict()
    out.update({k: summed[k] for k in _TOTALS})
    out["wall_s"] = round(sum(r.wall_s for r in rows), 2)
    out["errors"] = sum(r.error is not None for r in rows)
    return out


def summarize(run: EvalRun) -> dict[str, dict[str, Any]]:
    arms = [a for a in run.spec.arms if a not in run.skipped_arms]
    return {a: arm_totals([r for r in run.results if r.arm == a]) for a in arms}


REAL_WEIGHTS_NOTE = (
    "why so few resolve (real weights, no constraint): {valid} of {steps} model calls were valid "
    "calls of a debug-gym tool ({empty} replies held no tool call and were stored as "
    "empty_tool_response); solving a task takes reading the code, running the tests, editing "
    "and submitting within --max-steps {max_steps}, which a model that rarely writes a "
    "well-formed call cannot do. The token figures still compare the arms on the same agent"
)


def notes(run: EvalRun) -> list[str]:
    out = [RANDOM_WEIGHTS_NOTE] if run.backend.get("load_format") == "dummy" else []
    if not out and not run.constrained and run.results:
        steps = sum(r.steps for r in run.results)
        valid, empty = (sum(getattr(r, k) for r in run.results) for k in _STEPS[1:])
        out.append(REAL_WEIGHTS_NOTE.format(
            valid=valid, steps=steps, empty=empty, max_steps=run.spec.max_steps,
        ))  # fmt: skip
    if run.constrained:
        out.append(CONSTRAINED_NOTE.format(tools=", ".join(run.tools)))
    out.append(UNSANDBOXED_NOTE)
    out += [f"arm {a} skipped: {why}" for a, why in run.skipped_arms.items()]
    return out


def headline(summary: dict[str, dict[str, Any]], run: EvalRun, path: Path | None) -> dict[str, Any]:
    """The last stdout line."""
    keys: tuple[str, ...] = ("tasks", "resolved", "resolve_rate", "steps", "tool_calls")
    keys += ("edited_turns", "policy_edited_turns", "prompt_tokens", "reused_tokens")
    keys += ("prefilled_tokens", "edited_prefilled_tokens")
    arms = {a: {k: t[k] for k in keys} for a, t in summary.items()}
    doc: dict[str, Any] = {"arms": arms, "policy": run.spec.policy, "notes": notes(run)}
    doc["results"] = str(path) if path else None
    return doc


def table(summary: dict[str, dict[str, Any]], run: EvalRun) -> Table:
    title = f"debug-gym mini_nightmare, policy {run.spec.policy}, {len(run.spec.tasks)} tasks"
    t = Table(title=title)
    for col in ("task", "arm", "resolved", "steps", "tool calls", "edited"):
        t.add_column(col, justify="left" if col in ("task", "arm") else "right")
    for col in ("prompt tok", "prefilled", "hit rate", "edited prefilled", "wall s"):
        t.add_column(col, justify="right")
    for r in sorted(run.results, key=lambda r: (r.task, run.spec.arms.index(r.arm))):
        hit = r.totals.hit_rate
        t.add_row(
            r.task, r.arm, "yes" if r.resolved else ("error" if r.error else "no"),
            str(r.steps), str(r.tool_calls), str(r.totals.edited_turns),
            str(r.totals.prompt_tokens), str(r.totals.prefilled_tokens), f"{hit:.0%}",
            str(r.totals.edited_prefilled_tokens),
            f"{r.wall_s:.1f}",
        )  # fmt: skip
    t.add_section()
    for i, (arm, a) in enumerate(summary.items()):
        t.add_row(
            "TOTAL" if i == 0 else "", arm, f"{a['resolved']}/{a['tasks']}", str(a["steps"]),
            str(a["tool_calls"]), str(a["edited_turns"]), str(a["prompt_tokens"]),
            str(a["prefilled_tokens"]), f"{a['hit_rate']:.0%}", str(a["edited_prefilled_tokens"]),
            f"{a['wall_s']:.1f}", style="bold",
        )  # fmt: skip
    return t


def write_results(out: Path, run: EvalRun, summary: dict[str, dict[str, Any]]) -> Path:
    """``out/results.json``: arguments, environment, data, totals per arm, every task."""
    from leyline_agent.evals.debug_gym.venv import DEBUG_GYM_VERSION
    from leyline_agent.runinfo import environment

    out.mkdir(parents=True, exist_ok=True)
    env = environment(run.backend, versions={"debug-gym": DEBUG_GYM_VERSION})
    doc = {
        "arguments": run.spec.model_dump(mode="json"),
        "environment": env,
        "data": run.data,
        "tools": run.tools,
        "constrained_tool_calls": run.constrained,
        "notes": notes(run),
        "skipped_arms": run.skipped_arms,
        "wall_s": round(run.wall_s, 2),
        "arms": summary,
        "tasks": [r.model_dump(mode="json") for r in run.results],
    }
    path = out / "results.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def plot(out: Path, summary: dict[str, dict[str, Any]]) -> Path:
    """``tokens.png``: prompt tokens split into reused (cached) and prefilled, per arm, for all
    turns and for the edited turns; the resolve rate in each arm's label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(summary)
    colors = {"none": "#8c8c8c", "reprefill": "#d62728", "splice": "#1f77b4"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (title, pre) in zip(
        axes, (("all turns", ""), ("edited turns", "edited_")), strict=True
    ):
        prefilled = [summary[a][f"{pre}prefilled_tokens"] for a in arms]
        prompt = [summary[a][f"{pre}prompt_tokens"] for a in arms]
        reused = [max(0, p - f) for p, f in zip(prompt, prefilled, strict=True)]
        x = range(len(arms))
        ax.bar(x, prefilled, color=[colors.get(a, "#333") for a in arms], label="prefilled")
        ax.bar(x, reused, bottom=prefilled, color="#dddddd", label="reused (cached)")
        labels = [f"{a}\n{summary[a]['resolved']}/{summary[a]['tasks']} resolved" for a in arms]
        ax.set_xticks(list(x), labels)
        ax.set_ylabel("tokens")
        ax.set_title(f"prompt tokens, {title}")
        ax.legend(fontsize=8)
    fig.suptitle("debug-gym mini_nightmare through the Leyline proxy")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tokens.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
