"""`leyline proxy`: see the function docstrings. Heavy imports stay inside the commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from leyline_agent.commands.options import (
    Host,
    ModelName,
    Policy,
    Port,
    backend_key_option,
    served_model,
)

app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None)


@app.command("proxy")
def proxy(
    backend: Annotated[
        list[str],
        typer.Option(
            metavar="URL",
            help="Leyline-enabled SGLang server (leyline serve), e.g. http://h:30000; repeat for "
            "several: each session stays on one (rendezvous hashing of its namespace) and fails "
            "over to the next when it is down (docs/scale-out.md).",
        ),
    ],
    policy: Policy,
    port: Port = 8000,
    host: Host = "127.0.0.1",
    splice: Annotated[
        bool,
        typer.Option(
            "--splice/--no-splice",
            help="Send the policy's edits to /leyline/splice (--no-splice: re-prefill them).",
        ),
    ] = True,
    record: Annotated[
        Path | None,
        typer.Option(help="Write every turn's incoming messages as JSONL here (one per session)."),
    ] = None,
    model_path: Annotated[
        Path | None,
        typer.Option(help="Model directory the backend serves (its tokenizer and chat template)."),
    ] = None,
    model: ModelName = None,
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            "--api-key",
            envvar="LEYLINE_PROXY_API_KEYS",
            show_envvar=True,
            help="Client key, KEY or KEY=TENANT; repeat for several (env: whitespace-separated). "
            "Then every route but /health needs 'Authorization: Bearer KEY' (else 401), and "
            "sessions, cache namespaces, /leyline/sessions and /metrics are scoped by tenant. "
            "A KEY alone is a tenant of its own.",
        ),
    ] = None,
    backend_api_key: Annotated[
        str | None,
        backend_key_option(
            "The backend's key (leyline serve --api-key), sent on every upstream request."
        ),
    ] = None,
    health_interval: Annotated[
        float, typer.Option(min=0.1, help="Seconds between two polls of each backend's /health.")
    ] = 5.0,
    share_exact: Annotated[
        bool,
        typer.Option(
            "--share-exact/--no-share-exact",
            help="Sessions use their tenant's shared namespace (exact KV) until their first "
            "splice, then their own (--no-share-exact: their own from the first request).",
        ),
    ] = True,
) -> None:
    """OpenAI-compatible proxy: POST /v1/chat/completions with policy-driven cache edits.

    Point an agent's OPENAI_BASE_URL at http://HOST:PORT/v1. Sessions: the X-Leyline-Session
    header, else the request's `user` field, else the live anonymous session that this request
    extends (longest shared message prefix). Also serves GET /v1/models, /leyline/sessions,
    /leyline/sessions/ID and /metrics (Prometheus). See docs/proxy.md.
    """
    import uvicorn

    from leyline_agent.policies import PolicyError
    from leyline_agent.proxy import create_app
    from leyline_agent.proxy.auth import ApiKeys
    from leyline_agent.routing import rank

    model_path = served_model(model, model_path)
    try:
        ApiKeys(api_key or ())
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--api-key") from e
    try:
        rank(backend, "")
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--backend") from e
    try:
        api = create_app(
            backend, policy, splice=splice, record_dir=record, model_path=model_path,
            api_keys=api_key, backend_api_key=backend_api_key or None,
            health_interval=health_interval, share_exact=share_exact,
        )  # fmt: skip
    except PolicyError as e:
        raise typer.BadParameter(str(e), param_hint="--policy") from e
    except (FileNotFoundError, ValueError) as e:
        raise typer.BadParameter(str(e), param_hint="--model-path") from e
    typer.echo(
        f"leyline proxy on http://{host}:{port}/v1: backend {', '.join(backend)}, policy "
        f"{policy}, " + ("splices" if splice else "no splices (--no-splice: edits re-prefilled)"),
        err=True,
    )
    uvicorn.run(api, host=host, port=port, log_level="info")
