"""`leyline bench`: ``splice`` (engine level) and ``fidelity`` (paper §4.3), both run from an
installed package. Heavy imports stay inside the commands.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from leyline_agent.commands.options import ModelName, out_option, served_model

app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None)


@app.callback()
def bench() -> None:
    """Experiments of the paper, run against a real `leyline serve`."""


def _err(line: str) -> None:
    typer.echo(line, err=True)


@app.command()
def fidelity(
    model_path: Annotated[
        Path | None,
        typer.Option(
            help="trained model directory (with fidelity.json; its arch is read from there); "
            "default: train the tiny model of --arch, or reuse it from "
            "$LEYLINE_CACHE/fidelity-model/<hash>"
        ),
    ] = None,
    arch: Annotated[
        str,
        typer.Option(
            help="model trained and served: mla (DeepSeek-V2), gqa (Llama, 2 KV heads for 4 "
            "query heads), or both (then a comparison table)"
        ),
    ] = "mla",
    n: Annotated[int, typer.Option(help="cases per kind (4 kinds)")] = 500,
    out: Annotated[Path, out_option()] = Path("runs/fidelity"),
    backend: Annotated[
        str | None,
        typer.Option(help="URL of a running `leyline serve` of the model (default: start one)"),
    ] = None,
    dtype: Annotated[
        list[str] | None,
        typer.Option(help="KV/model dtype of the served model; repeat for several"),
    ] = None,
    train_steps: Annotated[
        int | None, typer.Option(help="training steps when training (default: the script's)")
    ] = None,
    architectures: Annotated[
        bool,
        typer.Option(
            "--architectures/--no-architectures",
            help="also run the mechanics checks on the four MLA shapes",
            metavar="",
        ),
    ] = True,
    drift: Annotated[
        bool,
        typer.Option(
            "--drift/--no-drift", help="also measure rope drift of composed splices", metavar=""
        ),
    ] = True,
    seed: Annotated[int, typer.Option(help="case generation seed")] = 1,
    model: ModelName = None,
    traces: Annotated[
        list[Path] | None,
        typer.Option(help="with --model: agent traces whose edited turns are the cases"),
    ] = None,
    budget: Annotated[
        int, typer.Option(help="with --model: tokens each turn is fitted to (see docs/fidelity.md)")
    ] = 1536,
    cap_chars: Annotated[
        list[int] | None,
        typer.Option(
            help="with --model: characters kept of each message (default 1200); repeat for one "
            "set of cases per cap"
        ),
    ] = None,
    rerun: Annotated[
        Path | None,
        typer.Option(help="with --model: run again only the cases of this cases.jsonl"),
    ] = None,
    policy: Annotated[
        list[str] | None,
        typer.Option(
            help="with --model: the edit, a policy spec; repeat for several (default "
            "stale_tool_outputs:keep_last=0..3, taken in turn)"
        ),
    ] = None,
    composed: Annotated[
        int,
        typer.Option(
            help="with --model: also this many sessions edited 1, 5 and 20 times in succession "
            "(--n 0: only those; bench/fidelity/composed.py)"
        ),
    ] = 0,
    task: Annotated[
        str,
        typer.Option(
            help="with --model: traces (the edited turns of --traces) or nl (the carried/direct/"
            "control task in natural language, --n cases per group; bench/fidelity/nl_task.py)"
        ),
    ] = "traces",
    workers: Annotated[
        int, typer.Option(min=1, help="with --task nl: cases in flight at once")
    ] = 1,
    group: Annotated[
        list[str] | None,
        typer.Option(
            help="with --task nl: a group of cases; repeat for several (default carried, direct, "
            "carried_ctrl, direct_ctrl; also used, used_ctrl)"
        ),
    ] = None,
) -> None:
    """The fidelity experiment (paper §4.3): full context vs AMORTIZE vs FORGET.

    With --model NAME (a real model, e.g. smollm2-135m-instruct): the edited turns of --traces
    on that model instead (leyline_agent/bench/fidelity/traces.py; at most --n cases), or with
    --task nl the natural-language carried/direct/control task (--n cases per group).

    Prints tables, writes results.json, cases-<label>.jsonl (label: the dtype for MLA,
    gqa-<dtype> for GQA) and fidelity.png into --out, then prints one JSON summary as the last
    stdout line. See docs/fidelity.md.
    """
    import dataclasses

    if model is not None:
        from leyline_agent.bench.fidelity.trace_run import run_traces

        model_dir = served_model(model, model_path)
        if model_dir is None:
            raise typer.BadParameter("the embedded model has random weights", param_hint="--model")
        if dtype and len(dtype) > 1:
            raise typer.BadParameter("with --model, give one --dtype", param_hint="--dtype")
        if task not in ("traces", "nl"):
            raise typer.BadParameter(f"--task {task!r}: use traces or nl", param_hint="--task")
        if task == "nl":
            from leyline_agent.bench.fidelity import nl_task
            from leyline_agent.bench.fidelity.nl_run import run_nl

            groups = group or list(nl_task.GROUPS)
            if bad := [g for g in groups if g not in nl_task.GROUPS + nl_task.EXTRA_GROUPS]:
                raise typer.BadParameter(f"unknown group {bad[0]!r}", param_hint="--group")
            d0 = dtype[0] if dtype else None
            summary = run_nl(
                model_dir, out, n=n, seed=seed, backend=backend, dtype=d0, workers=workers,
                groups=groups,
            )  # fmt: skip
            typer.echo(json.dumps({"out": str(out), "model": model, "task": "nl", **summary}))
            return
        summary = run_traces(
            model_dir, traces or [], out, n=n, budget=budget, caps=cap_chars, backend=backend,
            dtype=dtype[0] if dtype else None, rerun=rerun, composed=composed, policies=policy,
        )  # fmt: skip
        typer.echo(json.dumps({"out": str(out), "model": model, "summary": summary}))
        return

    from leyline_agent.bench.fidelity import arch_check as arch_mod
    from leyline_agent.bench.fidelity import divergence, report
    from leyline_agent.bench.fidelity import drift as drift_mod
    from leyline_agent.bench.fidelity import train as train_mod

    dtypes = dtype or ["float32"]
    if backend and len(dtypes) > 1:
        raise typer.BadParameter("with --backend, give one --dtype (the server's)")
    for d in dtypes:
        if d not in ("float32", "bfloat16"):
            raise typer.BadParameter(f"--dtype {d!r}: use float32 or bfloat16")
    if arch not in (*train_mod.ARCHS, "both"):
        raise typer.BadParameter(f"--arch {arch!r}: use mla, gqa or both")
    archs_run = [a for a in train_mod.ARCHS if arch in (a, "both")]
    if (model_path or backend) and len(archs_run) > 1:
        raise typer.BadParameter("--arch both trains and serves both models: no --model-path")
    model_paths: list[Path] = []
    if model_path is None:
        import torch

        torch.set_num_threads(1)
        for a in archs_run:
            spec = dataclasses.replace(train_mod.TrainSpec(), arch=a)
            if train_steps is not None:
                spec = dataclasses.replace(spec, steps=train_steps)
            res = train_mod.train(spec, log=_err)
            model_paths.append(res.model_dir)
            _err(f"{a}: " + train_mod.accuracy_table(res.info))
    elif not (model_path / "fidelity.json").is_file():
        raise typer.BadParameter(f"{model_path} has no fidelity.json", param_hint="--model-path")
    else:
        model_paths.append(model_path)

    spec_b = divergence.BenchSpec(n=n, seed=seed)
    benches = {}
    for path in model_paths:
        for d in dtypes:
            r = divergence.run(path, spec_b, backend=backend, dtype=d, log=_err)
            benches[report.bench_label(r["arch"], d)] = r
    archs = arch_mod.run(log=_err) if architectures else None
    drift_res = drift_mod.run() if drift else None
    results, text = report.build(out, benches, archs, drift_res)
    typer.echo(text)
    typer.echo(f"wrote {out / 'results.json'} and {out / 'fidelity.png'}")
    summary = {d: b["summary"] for d, b in results["bench"].items()}
    models = [str(p) for p in model_paths]
    typer.echo(json.dumps({"out": str(out), "models": models, "summary": summary}))


def _lengths(text: str) -> list[int]:
    try:
        return [int(x.strip().lower().replace("k", "")) * (1024 if "k" in x.lower() else 1)
                for x in text.split(",") if x.strip()]  # fmt: skip
    except ValueError as e:
        raise typer.BadParameter(f"expected lengths such as 1k,4k or 256,512: {e}") from e


@app.command()
def splice(
    lengths: Annotated[
        str, typer.Option(help="cached sequence lengths, comma-separated (k = 1024)")
    ] = "1k,4k,16k,32k",
    repeats: Annotated[int, typer.Option(min=1, help="trials per length (medians reported)")] = 3,
    edit_start: Annotated[int, typer.Option(min=0, help="first replaced token")] = 16,
    edit_end: Annotated[int, typer.Option(min=1, help="end of the replaced span")] = 48,
    replacement: Annotated[int, typer.Option(min=0, help="tokens of the replacement")] = 8,
    new_tokens: Annotated[
        int, typer.Option(min=1, help="new tokens appended in the request after the edit")
    ] = 4,
    backend: Annotated[
        str | None,
        typer.Option(
            help="a running `leyline serve` URL (any device); default: start one serving --model"
        ),
    ] = None,
    out: Annotated[Path, out_option()] = Path("runs/bench_splice"),
    seed: Annotated[int, typer.Option(help="seeds the token ids")] = 0,
    model: ModelName = None,
    page_size: Annotated[
        int,
        typer.Option(
            min=1, help="--page-size of the server it starts (KV pages; not with --backend)"
        ),
    ] = 1,
) -> None:
    """Engine-level latency of an edit near the start of a long cached sequence.

    Per length L: cache L random tokens, then time (a) POST /leyline/splice (one AMORTIZE
    directive) plus the next request, which should hit the cache in full, against (b) the same
    request re-prefilled in a cold namespace. Breaks the splice call down into replacement
    prefill, rotation and tree work (when the server reports them) and reads the server's peak
    RSS (when this command started it). Prints a table, writes OUT/results.json and
    OUT/splice.png, and prints as the last stdout line {"lengths": {L: {"splice_ms", "next_ms",
    "splice_total_ms", "reprefill_ms", "speedup", "splice_hit", ...}}, "out": ...}. See
    docs/bench_splice.md.
    """
    import httpx
    from pydantic import ValidationError
    from rich.console import Console

    from leyline_agent.bench import splice as sb
    from leyline_agent.client import LeylineClient, SpliceRejected
    from leyline_agent.runinfo import environment

    try:
        spec = sb.SpliceBenchSpec(
            lengths=_lengths(lengths), repeats=repeats, edit_start=edit_start, edit_end=edit_end,
            replacement=replacement, new_tokens=new_tokens, seed=seed, backend=backend,
        )  # fmt: skip
        spec.check()
    except (ValidationError, ValueError) as e:
        raise typer.BadParameter(str(e)) from e

    if backend is not None and page_size > 1:
        raise typer.BadParameter("--page-size is for the server this command starts, not --backend")
    server = None
    model_path = served_model(model, None)
    if backend is None:
        from leyline_agent.backends.sglang.launch import EmbeddedServer, ServerError
        from leyline_agent.models.registry import pool_tokens

        pool = max(pool_tokens(model_path), 4 * (max(spec.lengths) + 1024))
        _err(f"starting `leyline serve` (pool {pool:,} tokens; CPU: about a minute)")
        try:
            paged = ["--page-size", str(page_size)] if page_size > 1 else []
            server = EmbeddedServer(
                model_path=model_path, max_total_tokens=pool, extra_args=paged
            ).start()
        except ServerError as e:
            _err(str(e))
            raise typer.Exit(1) from e
        backend = server.url
    client = LeylineClient(backend)
    probe: sb.MemoryProbe = (
        sb.ProcMemory(server.proc.pid)
        if server is not None and server.proc is not None
        else sb.StatsMemory(client)
    )
    try:
        trials = sb.run(spec, client, probe=probe, log=_err)
        backend_info = {"url": backend, "started_here": server is not None}
        if server is not None:
            backend_info["page_size"] = page_size
    except (SpliceRejected, httpx.HTTPError) as e:
        _err(f"backend {backend} failed: {type(e).__name__}: {e}")
        raise typer.Exit(1) from e
    finally:
        client.close()
        if server is not None:
            server.stop()

    summary = sb.summarize(trials, page=page_size)
    path = sb.write_results(out, spec, summary, trials, environment(backend_info))
    png = sb.plot(out, summary, spec)
    console = Console()
    if not console.is_terminal:
        console = Console(width=150)
    console.print(sb.table(summary, spec))
    console.print(f"results: {path}; plot: {png}")
    typer.echo(json.dumps({"lengths": summary, "out": str(out), "memory_note": sb.MEMORY_NOTE}))
