"""Start and stop a ``leyline serve`` process (tests, ``leyline replay`` without ``--backend``).

Pure Python (httpx + subprocess); the server process itself needs the sglang extra.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerError(RuntimeError):
    """The server did not come up; the message carries the tail of its log."""


class EmbeddedServer:
    """``with EmbeddedServer() as srv: httpx.get(srv.url + "/health")``.

    Runs ``leyline serve`` (the embedded default model unless ``model_path``) on a free loopback
    port, waits until ``/health`` answers (up to ``timeout`` seconds), and kills it on exit.
    ``api_key``: the server requires it (``leyline serve --api-key``; ``/health`` stays open).

    Raises:
        ServerError: the process exited or did not answer in time (with its log tail).
    """

    def __init__(
        self,
        *,
        model_path: Path | None = None,
        port: int | None = None,
        max_total_tokens: int = 16384,
        extra_args: list[str] | None = None,
        timeout: float = 600.0,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.timeout = timeout
        self.log_path = Path(tempfile.mkstemp(prefix="leyline-serve-", suffix=".log")[1])
        self.argv = [
            sys.executable, "-m", "leyline_agent.cli", "serve",
            "--port", str(self.port),
            "--max-total-tokens", str(max_total_tokens),
        ]  # fmt: skip
        if model_path is not None:
            self.argv += ["--model-path", str(model_path)]
        self.argv += extra_args or []
        self.api_key = api_key
        self.env = {**os.environ, **(env or {})}
        if api_key:  # NOTE: through the environment, not argv (leyline serve reads it)
            self.env["LEYLINE_SERVE_API_KEY"] = api_key
        else:
            self.env.pop("LEYLINE_SERVE_API_KEY", None)
        self.proc: subprocess.Popen[bytes] | None = None

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(ln for ln in lines[-n:] if "server_args=" not in ln)

    def start(self) -> EmbeddedServer:
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"leyline serve exited ({self.proc.returncode}):\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise ServerError(f"leyline serve not ready after {self.timeout:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
