"""Two ``leyline serve`` workers behind the SGLang gateway ``smg`` on loopback, for the gateway tests
(``test_gateway.py``) and ``experiments/scale_out/gateway_run.py``.

``smg`` (PyPI ``smg``, a Rust binary in a wheel, pinned ``SMG_VERSION``) is installed once into a
venv of its own under ``$LEYLINE_CACHE`` (``agent_venv.ensure_venv``: a gateway binary, nothing we
import; the main venv's dev extra stays as it is). The gateway runs ``--policy consistent_hashing`` and hashes
``x-smg-routing-key`` (its built-in routing-key header), which the session layer sends.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
from agent_venv import ensure_venv

from leyline_agent import inband
from leyline_agent.backends.sglang.launch import EmbeddedServer, free_port

SMG_VERSION = "1.13.0"


def smg_binary() -> Path:
    """The ``smg`` executable (installed on first use)."""
    python = ensure_venv("smg", SMG_VERSION, f"smg=={SMG_VERSION}")
    return python.parent / "smg"


@contextmanager
def gateway(urls: list[str], log: Path | None = None) -> Iterator[str]:
    """``smg launch`` in front of ``urls``; yields its URL once every worker is routable."""
    port = free_port()
    argv = [
        str(smg_binary()), "launch", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *urls, "--policy", "consistent_hashing",
        "--prometheus-port", str(free_port()), "--log-level", "warn",
    ]  # fmt: skip
    out = log.open("w") if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"smg exited with {proc.returncode}")
            try:
                n = len(httpx.get(f"{url}/workers", timeout=5).json().get("workers", []))
            except (httpx.HTTPError, ValueError):
                n = 0
            if n == len(urls):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"smg has {n} of {len(urls)} workers after 120 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        if log is not None and hasattr(out, "close"):
            out.close()


@contextmanager
def workers(n: int = 2, max_total_tokens: int = 16384) -> Iterator[list[EmbeddedServer]]:
    """``n`` embedded workers (debug endpoints on), started at once."""
    env = {"LEYLINE_DEBUG_ENDPOINTS": "1"}
    servers = [EmbeddedServer(max_total_tokens=max_total_tokens, env=env) for _ in range(n)]
    try:
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda s: s.start(), servers))
        yield servers
    finally:
        for s in servers:
            s.stop()


def worker_id(url: str) -> str:
    """The ``x-leyline-worker`` id a worker (or the gateway, for a routing key) answers with."""
    r = httpx.post(
        f"{url}/generate",
        json={"input_ids": [1000], "sampling_params": {"max_new_tokens": 1}},
        timeout=120,
    )
    r.raise_for_status()
    return r.headers[inband.WORKER_HEADER]


def routed(gateway_url: str, key: str) -> str:
    """The worker id the gateway sends routing key ``key`` to."""
    r = httpx.post(
        f"{gateway_url}/generate",
        json={"input_ids": [1000], "sampling_params": {"max_new_tokens": 1}},
        headers={inband.ROUTING_HEADER: key},
        timeout=120,
    )
    r.raise_for_status()
    return r.headers[inband.WORKER_HEADER]


def served(proxy: str) -> str:
    """The served model name (the gateway routes chat requests by ``model``)."""
    return str(httpx.get(f"{proxy}/v1/models", timeout=60).json()["data"][0]["id"])
