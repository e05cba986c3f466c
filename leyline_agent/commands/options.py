"""Options that several commands share, declared once (typer ``Annotated`` aliases).

The default of an option stays at the parameter (``policy: Policy = "none"``; no default: the
option is required); where a spec class holds it, the command reads it from there with
``spec_default`` so that each default lives once. Options whose help differs per command share
their wiring through a function taking the help (``backend_key_option``, ``out_option``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel

Host = Annotated[str, typer.Option(help="Bind address.")]
Port = Annotated[int, typer.Option(help="HTTP port.")]
Policy = Annotated[
    str, typer.Option(help="policy spec, NAME[:key=value,...] (see docs/policies.md)")
]
ArmsPolicy = Annotated[
    str, typer.Option(help="policy of the reprefill and splice arms, NAME[:key=value,...]")
]
Arms = Annotated[str, typer.Option(help="comma-separated arms")]
EmbeddedBackend = Annotated[
    str | None,
    typer.Option(help="a running `leyline serve` URL; default: start the embedded one"),
]
ServedModelPath = Annotated[
    Path | None,
    typer.Option(help="model directory (tokenizer + chat template; served when embedded)"),
]
ModelName = Annotated[
    str | None,
    typer.Option(
        "--model",
        help="a registered model by name instead of --model-path: embedded (the default, random "
        "weights) or smollm2-135m-instruct (real weights, converted once into the cache)",
    ),
]


def backend_key_option(help: str) -> Any:
    """``--backend-api-key``: the backend's bearer token, also read from
    ``LEYLINE_BACKEND_API_KEY``; ``help`` says where the command sends it."""
    return typer.Option(envvar="LEYLINE_BACKEND_API_KEY", show_envvar=True, help=help)


def out_option(help: str = "results directory") -> Any:
    """``--out``: the directory a runner writes its results and plots into."""
    return typer.Option(help=help)


def spec_default(spec: type[BaseModel], name: str) -> Any:
    """The default of field ``name`` of a pydantic spec class (its factory called if it has one).

    Raises:
        KeyError: the class has no such field.
    """
    field = spec.model_fields[name]
    if field.default_factory is not None:
        return field.default_factory()  # type: ignore[call-arg]
    return field.default


def served_model(model: str | None, model_path: Path | None) -> Path | None:
    """``--model NAME`` / ``--model-path DIR`` -> the model directory (``None``: the embedded
    default), a registered model built on first use with a line on stderr. Bad input (both, an
    unknown name, a model whose source is missing) is a ``typer.BadParameter``."""
    from leyline_agent.models import resolve
    from leyline_agent.models.smollm2 import ModelBuildError

    try:
        return resolve(model, model_path, log=lambda m: typer.echo(m, err=True))
    except (ValueError, ModelBuildError) as e:
        raise typer.BadParameter(str(e), param_hint="--model") from e


def csv(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]`` (comma-separated option values)."""
    return [x.strip() for x in text.split(",") if x.strip()]
