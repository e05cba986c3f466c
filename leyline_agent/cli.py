"""The ``leyline`` command line (typer). Sub-commands import their heavy parts lazily."""

from __future__ import annotations

import typer

from leyline_agent import __version__
from leyline_agent.commands import bench, proxy, replay, serve, trace
from leyline_agent.commands import eval as eval_cmd

app = typer.Typer(
    name="leyline",
    help="Leyline: edit an LLM server's KV cache (AMORTIZE splices, FORGET purges) "
    "instead of re-prefilling.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,  # click's plain help: paragraphs re-wrapped, no <bool> type column
)


# Each sub-command lives in leyline_agent/commands/<name>.py and registers itself on its own app.
app.add_typer(trace.app, name="trace", help="Check a model's chat template and policies on traces.")
app.registered_commands += serve.app.registered_commands
app.registered_commands += proxy.app.registered_commands
app.registered_commands += replay.app.registered_commands
app.add_typer(
    bench.app,
    name="bench",
    help="Benchmarks: splice (a splice and the next request against a re-prefill, per cached "
    "length) and fidelity (a spliced cache's outputs against an exact one's).",
)
app.add_typer(eval_cmd.app, name="eval", help="Live benchmarks through the Leyline proxy.")


@app.command()
def version() -> None:
    """Print the installed version."""
    typer.echo(__version__)


if __name__ == "__main__":
    app()
