"""`leyline replay`: see the function docstrings. Heavy imports stay inside the commands."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Annotated

import typer

from leyline_agent.commands.options import (
    Arms,
    ArmsPolicy,
    ModelName,
    ServedModelPath,
    backend_key_option,
    csv,
    served_model,
    spec_default,
)
from leyline_agent.commands.progress import progress_bar
from leyline_agent.replay.spec import ReplaySpec

app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None)


@app.command("replay")
def replay(
    traces: Annotated[
        list[Path] | None,
        typer.Argument(
            exists=True,
            help="trace files or directories (SWE-agent .traj, debug-gym logs, OpenAI-message "
            "JSONL); none: the built-in examples",
        ),
    ] = None,
    examples: Annotated[
        bool,
        typer.Option("--examples", help="also replay the built-in example traces", metavar=""),
    ] = False,
    policy: ArmsPolicy = spec_default(ReplaySpec, "policy"),
    arms: Arms = ",".join(spec_default(ReplaySpec, "arms")),
    concurrency: Annotated[
        str, typer.Option(help="comma-separated levels: sessions in flight at once")
    ] = ",".join(map(str, spec_default(ReplaySpec, "concurrency"))),
    backend: Annotated[
        list[str] | None,
        typer.Option(
            metavar="URL",
            help="a running `leyline serve` URL; repeat for several (each session runs on its "
            "namespace's home backend, as in leyline proxy); default: start the embedded one",
        ),
    ] = None,
    backend_api_key: Annotated[
        str | None,
        backend_key_option(
            "--backend's key (leyline serve --api-key); never written to results.json"
        ),
    ] = None,
    out: Annotated[Path, typer.Option(help="directory for results.json and the plots")] = Path(
        "runs/replay"
    ),
    max_turns: Annotated[
        int | None, typer.Option(min=1, help="replay only the first N turns of each trace")
    ] = None,
    cap_chars: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="cut each message to its first N characters (made plain text, tool calls "
            "inline) before a turn is rendered, as bench fidelity --cap-chars: fits long traces "
            "into a small context",
        ),
    ] = None,
    model_path: ServedModelPath = None,
    model: ModelName = None,
    seed: Annotated[int, typer.Option(help="seeds the session submission order")] = spec_default(
        ReplaySpec, "seed"
    ),
    agreement: Annotated[
        bool,
        typer.Option(
            "--agreement/--no-agreement",
            help="compare the splice arm's argmax with an exact path",
            metavar="",
        ),
    ] = spec_default(ReplaySpec, "agreement"),
    wide: Annotated[
        bool,
        typer.Option(
            "--wide",
            help="every column (turns, edited, best, edited ms, ttft ms, splice ms, skipped), "
            "on 170 columns; the default fits 80",
            metavar="",
        ),
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="print the JSON line even on a terminal (always printed when stdout is not one)",
            metavar="",
        ),
    ] = False,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            help="show the embedded server's log as it starts (else only in its log file)",
            metavar="",
        ),
    ] = False,
) -> None:
    """Replay agent traces turn by turn through the arms none, reprefill and splice.

    Every turn sends the recorded messages (teacher-forced) and generates one token. Prints a
    progress bar on stderr (plain lines every 10 s when stderr is not a terminal; while the
    embedded server starts, a status line and its log file's path), a table led by the prefilled
    tokens per arm (80 columns; --wide: every column) and the result in words; writes
    OUT/results.json, OUT/prefilled.png (per arm), OUT/prefilled_turns.png (per turn along each
    trace), OUT/hit_rate.png and OUT/latency.png. With --json, or when stdout is not a terminal,
    the last stdout line is one JSON document: {"arms": {ARM: {"prefilled_tokens",
    "prompt_tokens", "reused_tokens", "hit_rate", "best_hit_rate", "mean_turn_ms",
    "skipped_turns", "skip_reasons", "argmax_agreement", ...}}, "levels": {...}, ...} for the
    first concurrency level. A turn that cannot run (the template or policy rejects it, or the
    backend refuses it with a 4xx, e.g. longer than the context) is skipped and counted with its
    reason. Exit status 2 when no trace was found. See docs/replay.md.
    """
    import httpx
    from pydantic import ValidationError
    from rich.console import Console

    from leyline_agent import runinfo
    from leyline_agent.chat.model_dir import load_renderer
    from leyline_agent.client import LeylineClient
    from leyline_agent.commands.progress import start_server
    from leyline_agent.policies import PolicyError, parse_policy
    from leyline_agent.replay import examples_dir, plots, report
    from leyline_agent.replay.runner import replay, total_turns
    from leyline_agent.replay.table import in_words, table
    from leyline_agent.traces import TraceFormatError, load

    err = Console(stderr=True)
    model_path = served_model(model, model_path)
    paths = list(traces or [])
    if examples or not paths:
        paths.append(examples_dir())
    try:
        levels = [int(c) for c in csv(concurrency)]
    except ValueError as e:
        raise typer.BadParameter(
            f"expected integers such as 1,8: {e}", param_hint="--concurrency"
        ) from e
    try:
        spec = ReplaySpec(
            traces=[str(p) for p in paths],
            policy=policy,
            arms=csv(arms),  # type: ignore[arg-type]
            concurrency=levels,
            max_turns=max_turns,
            cap_chars=cap_chars,
            model_path=str(model_path) if model_path else None,
            backend=backend[0] if backend else None,
            backends=list(backend or []),
            seed=seed,
            agreement=agreement,
        )
        parse_policy(policy)
    except ValidationError as e:
        msg = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        raise typer.BadParameter(msg) from e
    except PolicyError as e:
        raise typer.BadParameter(str(e), param_hint="--policy") from e

    if backend and len({u.rstrip("/") for u in backend}) != len(backend):
        raise typer.BadParameter(f"a backend is given twice: {backend}", param_hint="--backend")
    try:
        loaded = [t for p in paths for t in load(p) if t.turns]
    except TraceFormatError as e:
        raise typer.BadParameter(str(e), param_hint="TRACES") from e
    if not loaded:
        err.print(f"no traces found in {', '.join(map(str, paths))}")
        raise typer.Exit(2)
    renderer = load_renderer(model_path)

    server = None
    urls = list(backend or [])
    if not urls:
        from leyline_agent.backends.sglang.launch import EmbeddedServer, ServerError
        from leyline_agent.models.registry import pool_tokens

        server = EmbeddedServer(model_path=model_path, max_total_tokens=pool_tokens(model_path))
        try:
            start_server(server, err, verbose=verbose)
        except ServerError as e:
            err.print(str(e))
            raise typer.Exit(1) from e
        urls = [server.url]
        backend_api_key = None
    clients = [LeylineClient(u, api_key=backend_api_key or None) for u in urls]
    client = clients if len(clients) > 1 else clients[0]
    try:
        backend_info = runinfo.backend_info(clients[0].http)
        if len(clients) > 1:
            backend_info["backends"] = [runinfo.backend_info(c.http) for c in clients]
        label = f"{len(loaded)} traces x {len(spec.arms)} arms"
        total = total_turns(loaded, spec)
        if err.is_terminal:
            progress = progress_bar(err)
            with progress:
                task = progress.add_task(label, total=total)
                results = replay(
                    spec, client, renderer, loaded, on_turn=lambda _row: progress.advance(task)
                )
        else:  # a log file: plain lines, not a live bar
            results = replay(spec, client, renderer, loaded, on_turn=PlainProgress(label, total))
    except httpx.HTTPError as e:
        err.print(f"backend {', '.join(urls)} failed: {type(e).__name__}: {e}")
        raise typer.Exit(1) from e
    finally:
        for c in clients:
            c.close()
        if server is not None:
            server.stop()

    summary = report.summarize(results, spec.arms)
    env = runinfo.environment(backend_info)
    trace_info = [
        {"name": t.name, "source": t.source, "turns": len(t.turns[:max_turns])} for t in loaded
    ]
    path = report.write_results(out, spec, summary, results, trace_info, env)
    figures = plots.plot(out, summary, spec, results)
    console = Console()
    if wide or not console.is_terminal:  # every column, or a file: never squeeze the table
        console = Console(width=max(console.width, 170))
    console.print(table(summary, spec, wide=wide))
    for level, s in summary.items():
        words = in_words(s)
        if words:
            console.print((f"concurrency {level}: " if len(summary) > 1 else "") + " ".join(words))
    console.print(f"results: {path}; plots: {', '.join(p.name for p in figures)}")
    if as_json or not console.is_terminal:
        typer.echo(json.dumps(report.headline(summary, spec, path)))


class PlainProgress:
    """``on_turn`` callback for a log file: one line on stderr every ``every_s`` seconds and at the
    end (thread-safe: sessions run in parallel)."""

    def __init__(self, label: str, total: int, every_s: float = 10.0):
        self.label, self.total, self.every_s = label, total, every_s
        self.done = 0
        self.t0 = self.last = time.monotonic()
        self.lock = threading.Lock()

    def __call__(self, row: object) -> None:
        with self.lock:
            self.done += 1
            now = time.monotonic()
            if now - self.last < self.every_s and self.done < self.total:
                return
            self.last = now
            line = f"replay {self.label}: {self.done}/{self.total} turns, {now - self.t0:.0f} s"
        typer.echo(line, err=True)
