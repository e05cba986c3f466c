"""`leyline trace`: see the function docstrings. Heavy imports stay inside the commands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from leyline_agent.commands.options import Policy

app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None)


@app.callback()
def trace() -> None:
    """Check a model's chat template and a policy on recorded agent traces."""


@app.command()
def check(
    paths: Annotated[list[Path], typer.Argument(help="trace files or directories")],
    policy: Policy = "none",
    model_path: Annotated[
        Path | None,
        typer.Option(help="model directory (tokenizer.json + chat template); default: embedded"),
    ] = None,
) -> None:
    """Replay every turn of every trace through the wrapper: template, policy and diff.

    Per turn: apply the policy, render with the model's chat template and diff against the
    previous turn's prompt. Every plan is token-exact by construction (the wrapper verifies that
    applying the directives and appending the tail gives the rendered prompt, and falls back to
    one covering directive otherwise); what this reports is where a template or a policy fails,
    and where the diff needed a fallback. Use a policy that edits (e.g.
    stale_tool_outputs:keep_last=2): with the default `none` the history only grows and nothing
    is spliced.

    Table, per trace: turns; edited (turns with at least one directive); directives; fallback
    (turns where tokens differed although the messages did not, template instability or changed
    tools, or where one covering directive replaced the rest); errors (turns the template or the
    policy rejected, reported on stderr); prompt (tokens of the last prompt); prefill (tokens a
    splicing engine prefills over the whole trace: new tails plus replacements). The last stdout
    line is {"traces", "turns", "edited_turns", "directives", "fallback", "errors"}, the same
    counts summed over all traces. Every file under a directory that gives no trace is named on
    stderr with the reason ("skipped PATH: REASON"). Exit status 1 when a turn was rejected, 2
    when no trace was found.
    """
    import jinja2
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from leyline_agent.chat.model_dir import load_renderer
    from leyline_agent.policies import PolicyError, parse_policy
    from leyline_agent.traces import Skipped, Trace, load
    from leyline_agent.wrapper import ConversationWrapper

    err = Console(stderr=True)
    try:
        policy_obj = parse_policy(policy)
    except PolicyError as e:
        raise typer.BadParameter(str(e), param_hint="--policy") from e
    renderer = load_renderer(model_path)
    missing = [str(p) for p in paths if not Path(p).exists()]
    if missing:
        err.print(f"no such file or directory: {', '.join(missing)}")
        raise typer.Exit(2)
    traces: list[Trace] = []
    skipped: list[Skipped] = []
    for p in paths:
        loaded = load(p)
        traces += loaded
        skipped += loaded.skipped
    for path, reason in skipped:  # every file that gave no trace, named
        err.print(f"skipped {path}: {reason}", markup=False, highlight=False, soft_wrap=True)
    if not traces:
        err.print(f"no traces found in {', '.join(map(str, paths))}")
        raise typer.Exit(2)

    table = Table(title=f"trace check (policy {policy})", caption=f"template: {renderer.source}")
    table.add_column("trace", overflow="fold")
    for col in ("turns", "edited", "directives", "fallback", "errors", "prompt", "prefill"):
        table.add_column(col, justify="right", no_wrap=True)
    totals = dict.fromkeys(("turns", "edited_turns", "directives", "fallback", "errors"), 0)
    with Progress(console=err, transient=True) as progress:
        task = progress.add_task("turns", total=sum(len(t.turns) for t in traces))
        for trace in traces:
            wrapper = ConversationWrapper(renderer, policy_obj)
            row = dict.fromkeys(("turns", "edited", "directives", "fallback", "errors"), 0)
            prefill = 0
            for turn, messages in enumerate(trace.turns):
                row["turns"] += 1
                progress.advance(task)
                try:
                    plan = wrapper.plan(messages, trace.tools)
                except (jinja2.TemplateError, PolicyError) as e:
                    err.print(f"{trace.name} turn {turn}: {type(e).__name__}: {e}", markup=False)
                    row["errors"] += 1
                    wrapper.reset()
                    continue
                row["edited"] += bool(plan.directives)
                row["directives"] += len(plan.directives)
                row["fallback"] += int(plan.fallback)
                prefill += len(plan.tail) + sum(len(d.replacement) for d in plan.directives)
                wrapper.commit(plan)
            for key, value in row.items():
                totals["edited_turns" if key == "edited" else key] += value
            table.add_row(
                trace.name, *map(str, row.values()), str(len(wrapper.tokens)), str(prefill)
            )
    out = Console()
    (out if out.is_terminal else Console(width=160)).print(table)
    typer.echo(json.dumps({"traces": len(traces), **totals}))
    if totals["errors"]:
        raise typer.Exit(1)
