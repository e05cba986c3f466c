"""`leyline eval`: live benchmarks through the Leyline proxy. Heavy imports stay inside commands."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Annotated

import typer

from leyline_agent.commands.options import (
    Arms,
    ArmsPolicy,
    EmbeddedBackend,
    ServedModelPath,
    backend_key_option,
    csv,
    served_model,
    spec_default,
)
from leyline_agent.commands.progress import progress_bar
from leyline_agent.evals.debug_gym.spec import EvalSpec

app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None)


@app.callback()
def main() -> None:
    """Live benchmarks: a real agent whose LLM calls go through the Leyline proxy."""


@app.command("debug-gym")
def debug_gym(
    tasks: Annotated[
        str, typer.Option(help="'all' or comma-separated mini_nightmare tasks")
    ] = "all",
    arms: Arms = ",".join(spec_default(EvalSpec, "arms")),
    policy: ArmsPolicy = spec_default(EvalSpec, "policy"),
    backend: EmbeddedBackend = None,
    llm_url: Annotated[
        str | None,
        typer.Option(help="any OpenAI-compatible endpoint (splice arm only if Leyline-enabled)"),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="a registered model (embedded, smollm2-135m-instruct: served here, or the one "
            "--backend serves), else the model name for --llm-url (default: its first model)"
        ),
    ] = None,
    backend_api_key: Annotated[
        str | None,
        backend_key_option(
            "key of --backend / --llm-url (sent as a bearer token; never written out)"
        ),
    ] = None,
    max_steps: Annotated[int, typer.Option(min=1, help="model calls per task")] = spec_default(
        EvalSpec, "max_steps"
    ),
    data_dir: Annotated[
        Path | None,
        typer.Option(help="mini_nightmare tasks (default: debug-gym's cache or download)"),
    ] = None,
    out: Annotated[Path, typer.Option(help="results.json, tokens.png, logs")] = Path(
        "runs/debug_gym"
    ),
    tools: Annotated[
        str | None,
        typer.Option(
            help="debug-gym tools (default: view,listdir,eval with random weights, else "
            "view,listdir,eval,edit,submit; bash runs unsandboxed on this host)"
        ),
    ] = None,
    constrain: Annotated[
        bool | None,
        typer.Option(
            "--constrain/--no-constrain",
            help="force read-only tool calls by constrained decoding (default: when the backend "
            "serves dummy weights)",
        ),
    ] = None,
    max_tokens: Annotated[
        int, typer.Option(min=1, help="max_tokens per model call")
    ] = spec_default(EvalSpec, "max_tokens"),
    context_limit: Annotated[
        int, typer.Option(min=1, help="debug-gym's context limit, thousands of tokens")
    ] = spec_default(EvalSpec, "context_limit_k"),
    model_path: ServedModelPath = None,
    venv: Annotated[
        Path | None,
        typer.Option(help="debug-gym's venv (default: $LEYLINE_CACHE/debug-gym-1.3.0/venv)"),
    ] = None,
) -> None:
    """Run debug-gym's mini_nightmare (froggy agent) with its LLM calls through the proxy.

    Per arm (none: no policy; reprefill: the policy, edited requests re-prefilled; splice: the
    policy's edits spliced into the cache) a proxy serves the agent; debug-gym runs in its own
    venv (created on first use, about a minute), each task in a throwaway directory, its tools
    unsandboxed on this host. Prints a progress bar (stderr) and a table, writes OUT/results.json
    and OUT/tokens.png, and prints as the last stdout line {"arms": {ARM: {"tasks", "resolved",
    "tool_calls", "edited_turns", "prompt_tokens", "cached_tokens", "prefilled_tokens", ...}}}.
    With the embedded default (random weights) nothing can be solved; tool calls are forced to
    read-only tools so the run still exercises tool outputs, policies and splices. See
    docs/debug_gym.md.
    """
    from pydantic import ValidationError
    from rich.console import Console

    from leyline_agent.backends.sglang.launch import ServerError
    from leyline_agent.evals.debug_gym import report
    from leyline_agent.evals.debug_gym.runner import EvalError, run_eval
    from leyline_agent.evals.debug_gym.spec import parse_tasks
    from leyline_agent.evals.debug_gym.venv import VenvError
    from leyline_agent.policies import PolicyError, parse_policy

    if backend and llm_url:
        raise typer.BadParameter("give --backend or --llm-url, not both")
    from leyline_agent.models import MODELS

    if model in MODELS and not llm_url:  # a registered model: its directory, not an API name
        model_path, model = served_model(model, model_path), None
    try:
        spec = EvalSpec(
            tasks=parse_tasks(tasks),
            arms=csv(arms),  # type: ignore[arg-type]
            policy=policy,
            backend=backend,
            llm_url=llm_url,
            model=model,
            model_path=str(model_path) if model_path else None,
            max_steps=max_steps,
            data_dir=str(data_dir) if data_dir else None,
            out=str(out),
            tools=csv(tools) if tools else None,
            constrain=constrain,
            max_tokens=max_tokens,
            context_limit_k=context_limit,
            venv=str(venv) if venv else None,
        )
        parse_policy(policy)
    except ValidationError as e:
        raise typer.BadParameter(str(e)) from e
    except PolicyError as e:
        raise typer.BadParameter(str(e), param_hint="--policy") from e

    err = Console(stderr=True)
    progress = progress_bar(err)
    total = len(spec.tasks) * len(spec.arms) * spec.max_steps
    bar = progress.add_task(f"{len(spec.tasks)} tasks x {len(spec.arms)} arms", total=total)

    def on_event(e: dict) -> None:
        if e["event"] == "task_start":
            progress.update(bar, description=f"{e['arm']}: {e['task']}")
        elif e["event"] == "step":
            progress.advance(bar)
        elif e["event"] == "task_end":  # an episode may end before max_steps
            progress.advance(bar, max(0, spec.max_steps - int(e.get("steps") or 0)))

    def terminated(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwinds: stops the driver, the proxies, the embedded server

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        with progress:
            run = run_eval(
                spec,
                on_event=on_event,
                log=lambda m: err.print(m),
                backend_api_key=backend_api_key if (backend or llm_url) else None,
            )
    except (EvalError, VenvError, ServerError) as e:
        err.print(f"[red]leyline eval debug-gym failed:[/red] {e}")
        raise typer.Exit(1) from e
    finally:
        signal.signal(signal.SIGTERM, previous)
    summary = report.summarize(run)
    path = report.write_results(spec.out_dir, run, summary)
    png = report.plot(spec.out_dir, summary)
    console = Console()
    if not console.is_terminal:  # piped: rich would assume 80 columns and truncate the table
        console = Console(width=150)
    console.print(report.table(summary, run))
    for note in report.notes(run):
        console.print(f"note: {note}")
    console.print(f"results: {path}; plot: {png}")
    typer.echo(json.dumps(report.headline(summary, run, path)))
