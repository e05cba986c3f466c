"""`leyline serve`: launch SGLang with the Leyline plugin (and the embedded default model)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from leyline_agent.backends.sglang.launch import CPU_MAX_RUNNING_REQUESTS, DEFAULT_MAX_TOTAL_TOKENS
from leyline_agent.commands.options import Host, ModelName, Port, served_model

app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None)


@app.command(
    "serve",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def serve(
    ctx: typer.Context,
    model_path: Annotated[
        Path | None,
        typer.Option(
            help="Hugging Face model directory. Default: the embedded tiny DeepSeek-V2 "
            "(random weights: mechanics, not quality)."
        ),
    ] = None,
    model: ModelName = None,
    port: Port = 30000,
    host: Host = "127.0.0.1",
    dtype: Annotated[
        str | None,
        typer.Option(
            help="KV/model dtype (SGLang --dtype). Default: the model's; on a CPU without bf16 "
            "units, float32 for a registered real model (--model NAME)."
        ),
    ] = None,
    max_total_tokens: Annotated[
        int | None,
        typer.Option(
            help=f"KV pool size in tokens (default on CPU: two contexts of the model, "
            f"{DEFAULT_MAX_TOTAL_TOKENS} for the embedded one)."
        ),
    ] = None,
    max_running_requests: Annotated[
        int | None,
        typer.Option(help=f"Requests in flight (default {CPU_MAX_RUNNING_REQUESTS} on CPU)."),
    ] = None,
    max_pinned_fraction: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            max=1.0,
            help="Most of the KV pool that pins (POST /leyline/pin) may hold; a pin beyond it "
            "gets 429 (default 0.5).",
        ),
    ] = None,
    dummy: Annotated[
        bool | None,
        typer.Option(
            "--dummy/--no-dummy",
            help="Random weights (SGLang --load-format dummy): mechanics, not quality. "
            "Default: on for the embedded model, off with --model-path.",
            metavar="",
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="LEYLINE_SERVE_API_KEY",
            show_envvar=True,
            help="Require 'Authorization: Bearer KEY' on every route (SGLang's --api-key; "
            "/leyline/splice and /leyline/stats included; /health and /metrics stay open).",
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the SGLang command and exit.", metavar="")
    ] = False,
) -> None:
    """Launch SGLang with the Leyline plugin: POST /leyline/splice, the leyline radix cache.

    Extra arguments are passed to SGLang's launch_server unchanged. Without CUDA it enables the
    CPU dev mode (leyline_agent/backends/sglang/cpu_dev.py) and the leyline_cpu attention backend,
    and sizes the KV pool for two contexts of the model (131,072 tokens each for the embedded one;
    8,192 for smollm2-135m-instruct). The OpenAI endpoints serve the model under its path
    (SGLang's --served-model-name overrides it).
    """
    from leyline_agent.backends.sglang.launch import cuda_available, server_command
    from leyline_agent.models.registry import cpu_dtype, pool_tokens

    cpu = not cuda_available()
    model_path = served_model(model, model_path)
    if dummy is None:
        dummy = model_path is None
    if model_path is None:
        from leyline_agent.embedded.model import default_model_dir

        model_path = default_model_dir()
        dtype = dtype or "bfloat16"
    elif not (model_path / "config.json").is_file():
        raise typer.BadParameter(f"{model_path} has no config.json", param_hint="--model-path")
    if cpu and dtype is None:
        dtype = cpu_dtype(model_path)
    if cpu and max_total_tokens is None:
        max_total_tokens = pool_tokens(model_path)
    if cpu and max_running_requests is None:
        max_running_requests = CPU_MAX_RUNNING_REQUESTS
    extra = list(ctx.args)
    if max_running_requests is not None:
        extra = ["--max-running-requests", str(max_running_requests), *extra]
    argv, env = server_command(
        model_path, port=port, host=host, dummy=dummy, dtype=dtype,
        max_total_tokens=max_total_tokens, extra=extra, cpu=cpu, api_key=api_key or None,
        max_pinned_fraction=max_pinned_fraction,
    )  # fmt: skip
    if dry_run:
        typer.echo(" ".join("***" if api_key and a == api_key else a for a in argv))
        return
    os.execvpe(argv[0], argv, env)
