"""The backend behind the proxies, and the in-process proxy of one arm.

``open_backend`` yields what the run talks to: the embedded ``leyline serve`` (started and
stopped here), a running ``leyline serve`` (``--backend``) or any OpenAI-compatible endpoint
(``--llm-url``). ``probe_backend`` asks it whether it serves random weights (SGLang's
``/get_model_info``: ``load_format == "dummy"``) and whether it can splice (``/leyline/stats``;
both through ``runinfo.backend_info``).
``ProxyServer`` serves ``leyline_agent.proxy.create_app`` on a loopback thread. A backend that
needs a key (``leyline serve --api-key``, a hosted endpoint) gets it on the probe and from the
proxy on every forwarded request (``Backend.api_key``, never written to the results).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from leyline_agent.backends.sglang.launch import free_port
from leyline_agent.client import auth_headers
from leyline_agent.evals.debug_gym.spec import EvalSpec
from leyline_agent.runinfo import backend_info


class EvalError(RuntimeError):
    """The run could not start or a driver failed as a whole (message says why)."""


@dataclass
class Backend:
    """What the proxy forwards to: ``url`` without ``/v1``; ``leyline``: it serves
    ``/leyline/splice``; ``dummy``: it serves random weights; ``api_key``: its key."""

    url: str
    model: str
    leyline: bool
    dummy: bool
    info: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = field(default=None, repr=False)


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def probe_backend(url: str, model: str | None, api_key: str | None = None) -> Backend:
    """Ask the backend what it is (SGLang's ``/get_model_info``, Leyline's ``/leyline/stats``).

    Raises:
        EvalError: the backend refuses the key (401/403), or needs one and got none.
    """
    url = _base_url(url)
    with httpx.Client(base_url=url, timeout=10, headers=auth_headers(api_key)) as http:
        try:
            status = http.get("/v1/models").status_code
        except httpx.HTTPError:
            status = None
        if status in (401, 403):
            what = "refuses the key" if api_key else "needs a key (--backend-api-key)"
            raise EvalError(f"{url} {what}: GET /v1/models answered {status}")
        info = backend_info(http)
        if model is None:
            try:
                model = http.get("/v1/models").json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
                model = "default"
    dummy = info.get("load_format") == "dummy"
    return Backend(url, model, info["leyline"], dummy, info, api_key=api_key)


@contextmanager
def open_backend(
    spec: EvalSpec, log: Callable[[str], None], api_key: str | None = None
) -> Iterator[Backend]:
    """The backend of the run; the embedded ``leyline serve`` is started and stopped here.
    ``api_key``: the key of ``--backend`` / ``--llm-url`` (the embedded server needs none)."""
    if spec.llm_url or spec.backend:
        yield probe_backend(spec.llm_url or spec.backend or "", spec.model, api_key)
        return
    from leyline_agent.backends.sglang.launch import EmbeddedServer
    from leyline_agent.models.registry import pool_tokens

    log("starting the embedded `leyline serve` (CPU: about a minute) ...")
    model_path = Path(spec.model_path) if spec.model_path else None
    with EmbeddedServer(
        model_path=model_path, max_total_tokens=pool_tokens(model_path), timeout=600
    ) as srv:
        yield probe_backend(srv.url, spec.model)


class ProxyServer:
    """``create_app(backend, policy, splice=...)`` served by uvicorn on a loopback thread."""

    def __init__(
        self,
        backend: str,
        policy: str,
        *,
        splice: bool,
        model_path: str | None,
        backend_api_key: str | None = None,
    ):
        import uvicorn

        from leyline_agent.proxy import create_app

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # NOTE: sharing off: the arms run on one backend, and each arm's prefilled tokens must
        # be its own (no arm may hit another's exact KV in a shared namespace)
        app = create_app(
            backend,
            policy,
            splice=splice,
            model_path=model_path,
            backend_api_key=backend_api_key,
            share_exact=False,
        )
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="leyline-proxy", daemon=True)

    def __enter__(self) -> ProxyServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise EvalError(f"the proxy did not start on port {self.port}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def session(self, session_id: str) -> dict[str, Any] | None:
        r = httpx.get(f"{self.url}/leyline/sessions/{session_id}", timeout=30)
        return r.json() if r.status_code == 200 else None
