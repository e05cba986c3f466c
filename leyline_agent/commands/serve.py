"""`leyline serve`: launch SGLang with the Leyline plugin (and the embedded default model)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False)


def default_model_dir() -> Path:
    from leyline_agent.cache import cache_root

    return cache_root() / "embedded-deepseek-v2"


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
    port: Annotated[int, typer.Option(help="HTTP port.")] = 30000,
    host: Annotated[str, typer.Option(help="Bind address.")] = "127.0.0.1",
    dtype: Annotated[str | None, typer.Option(help="KV/model dtype (SGLang --dtype).")] = None,
    max_total_tokens: Annotated[
        int | None, typer.Option(help="KV pool size in tokens (default 32768 on CPU).")
    ] = None,
    dry_run: Annotated[bool, typer.Option(help="Print the SGLang command and exit.")] = False,
) -> None:
    """Launch SGLang with the Leyline plugin: POST /leyline/splice, the leyline radix cache.

    Extra arguments are passed to SGLang's launch_server unchanged. Without CUDA it enables the
    CPU dev mode (two patches, see leyline_agent/backends/sglang/cpu_dev.py) and the torch_native
    attention backend.
    """
    try:
        from leyline_agent.backends.sglang.launch import cuda_available, server_command
    except ImportError as e:  # pragma: no cover - depends on the install
        raise typer.BadParameter(f"leyline serve needs the sglang extra: {e}") from e
    cpu = not cuda_available()
    dummy = model_path is None
    if model_path is None:
        from leyline_agent.backends.sglang.model import write_embedded_model

        model_path = write_embedded_model(default_model_dir())
        dtype = dtype or "bfloat16"
    elif not (model_path / "config.json").is_file():
        raise typer.BadParameter(f"{model_path} has no config.json", param_hint="--model-path")
    if cpu and max_total_tokens is None:
        max_total_tokens = 32768
    argv, env = server_command(
        model_path, port=port, host=host, dummy=dummy, dtype=dtype,
        max_total_tokens=max_total_tokens, extra=list(ctx.args), cpu=cpu,
    )  # fmt: skip
    if dry_run:
        typer.echo(" ".join(argv))
        return
    os.execvpe(argv[0], argv, env)
