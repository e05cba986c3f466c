"""`leyline bench`: experiments that need a source checkout (``experiments/`` beside the package).

Heavy imports stay inside the commands.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False)


@app.callback()
def bench() -> None:
    """Experiments of the paper, run against a real `leyline serve`."""


def _err(line: str) -> None:
    typer.echo(line, err=True)


def _checkout_root() -> Path:
    """The repository root holding ``experiments/`` (an editable install); put it on sys.path."""
    import leyline_agent

    root = Path(leyline_agent.__file__).resolve().parents[1]
    if not (root / "experiments" / "fidelity" / "task.py").is_file():
        raise typer.BadParameter(
            f"no experiments/fidelity next to {root / 'leyline_agent'}: `leyline bench` needs a "
            "source checkout installed with `pip install -e .`"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return root


@app.command()
def fidelity(
    model_path: Annotated[
        Path | None,
        typer.Option(
            help="trained model directory (with fidelity.json); default: train the tiny MLA "
            "model, or reuse it from $LEYLINE_CACHE/fidelity-model/<hash>"
        ),
    ] = None,
    n: Annotated[int, typer.Option(help="cases per kind (4 kinds)")] = 500,
    out: Annotated[Path, typer.Option(help="results directory")] = Path("runs/fidelity"),
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
        bool, typer.Option(help="also run the mechanics checks on the four MLA shapes")
    ] = True,
    drift: Annotated[bool, typer.Option(help="also measure rope drift of composed splices")] = True,
    seed: Annotated[int, typer.Option(help="case generation seed")] = 1,
) -> None:
    """The fidelity experiment (paper §4.3): full context vs AMORTIZE vs FORGET.

    Prints tables, writes results.json, cases-<dtype>.jsonl and fidelity.png into --out, then
    prints one JSON summary as the last stdout line. See docs/fidelity.md.
    """
    import dataclasses

    _checkout_root()
    from experiments.fidelity import architectures as arch_mod
    from experiments.fidelity import bench as bench_mod
    from experiments.fidelity import drift as drift_mod
    from experiments.fidelity import report, train_tiny_mla

    dtypes = dtype or ["float32"]
    if backend and len(dtypes) > 1:
        raise typer.BadParameter("with --backend, give one --dtype (the server's)")
    for d in dtypes:
        if d not in ("float32", "bfloat16"):
            raise typer.BadParameter(f"--dtype {d!r}: use float32 or bfloat16")
    if model_path is None:
        import torch

        torch.set_num_threads(1)
        spec = train_tiny_mla.TrainSpec()
        if train_steps is not None:
            spec = dataclasses.replace(spec, steps=train_steps)
        res = train_tiny_mla.train(spec, log=_err)
        model_path = res.model_dir
        _err(train_tiny_mla.accuracy_table(res.info))
    elif not (model_path / "fidelity.json").is_file():
        raise typer.BadParameter(f"{model_path} has no fidelity.json", param_hint="--model-path")

    spec_b = bench_mod.BenchSpec(n=n, seed=seed)
    benches = {
        d: bench_mod.run(model_path, spec_b, backend=backend, dtype=d, log=_err) for d in dtypes
    }
    archs = arch_mod.run(log=_err) if architectures else None
    drift_res = drift_mod.run() if drift else None
    results, text = report.build(out, benches, archs, drift_res)
    typer.echo(text)
    typer.echo(f"wrote {out / 'results.json'} and {out / 'fidelity.png'}")
    summary = {d: b["summary"] for d, b in results["bench"].items()}
    typer.echo(json.dumps({"out": str(out), "model": str(model_path), "summary": summary}))
