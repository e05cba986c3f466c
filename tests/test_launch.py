"""``launch.wait_healthy``: the one wait for ``/health`` that ``EmbeddedServer``, the proxy tests
and the proxy-overhead bench share (no sglang, no server: small Python processes)."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from rich.console import Console

from leyline_agent.backends.sglang.launch import (
    EmbeddedServer,
    ServerError,
    free_port,
    read_tail,
    wait_healthy,
)
from leyline_agent.commands.progress import start_server

HEALTH_SERVER = textwrap.dedent(
    """
    import sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """
)


def _start(code: str, *args: str, log: Path | None = None) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-c", code, *args]
    if log is None:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


def test_wait_healthy_returns_once_health_answers() -> None:
    port = free_port()
    proc = _start(HEALTH_SERVER, str(port))
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, 30, poll_s=0.1)
        assert proc.poll() is None  # left running
    finally:
        proc.kill()
        proc.wait()


def test_wait_healthy_reports_exit_code_and_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "p.log"
    code = "import sys; print('server_args=...'); print('boom: no model'); sys.exit(3)"
    proc = _start(code, log=log)
    with pytest.raises(ServerError) as e:
        wait_healthy("http://127.0.0.1:9", proc, 30, name="leyline proxy", poll_s=0.1,
                     log_tail=lambda: read_tail(log))  # fmt: skip
    msg = str(e.value)
    assert msg.startswith("leyline proxy exited (3):\n") and "boom: no model" in msg
    assert "server_args=" not in msg  # read_tail drops SGLang's argument dump


def test_wait_healthy_times_out_and_leaves_the_process() -> None:
    proc = _start("import time; time.sleep(60)")
    try:
        with pytest.raises(ServerError, match=r"^server not ready after 1s$"):
            wait_healthy(f"http://127.0.0.1:{free_port()}", proc, 1.0, poll_s=0.1)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_read_tail(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    assert read_tail(log) == ""  # missing
    log.write_text("".join(f"line {i}\n" for i in range(50)))
    assert read_tail(log, 3) == "line 47\nline 48\nline 49"


SGLANG_LIKE = (
    textwrap.dedent(
        """
    import sys, time
    print("warnings.warn(", flush=True)
    print("[2026-12-03 22:41:11] Load weight begin.", flush=True)
    time.sleep(0.6)
    print("[2026-12-03 22:41:12] Capture cuda graph skipped.", flush=True)
    """
    )
    + HEALTH_SERVER
)


def _fake_server(tmp_path: Path) -> EmbeddedServer:
    """An ``EmbeddedServer`` whose process is a small script that logs like SGLang, then answers
    ``/health`` (SGLang itself cannot start in a unit test)."""
    srv = EmbeddedServer(timeout=30)
    srv.argv = [sys.executable, "-c", SGLANG_LIKE, str(srv.port)]
    return srv


def test_start_server_shows_progress_and_keeps_the_log_out(tmp_path: Path) -> None:
    out = io.StringIO()
    srv = _fake_server(tmp_path)
    try:
        start_server(srv, Console(file=out, width=200, force_terminal=False), every_s=0.0)
    finally:
        srv.stop()
    text = out.getvalue()
    assert text.startswith(f"starting the embedded leyline serve (log: {srv.log_path})\n")
    phases = r"starting Python|Load weight begin\.|Capture cuda graph skipped\."
    assert re.search(rf"^starting leyline serve: \d+ s \(({phases})\)$", text, re.M), text
    assert text.rstrip().endswith(f"leyline serve ready at {srv.url}")
    assert "[2026-12-03" not in text and "warnings.warn" not in text  # the log stays in its file
    assert "Load weight begin." in srv.log_path.read_text()
    assert srv.phase() == "Capture cuda graph skipped."


def test_start_server_verbose_shows_the_log(tmp_path: Path) -> None:
    out = io.StringIO()
    srv = _fake_server(tmp_path)
    try:
        start_server(srv, Console(file=out, width=200, force_terminal=False), verbose=True)
    finally:
        srv.stop()
    text = out.getvalue()
    assert "[2026-12-03 22:41:11] Load weight begin." in text
    assert "[2026-12-03 22:41:12] Capture cuda graph skipped." in text


def test_interrupted_start_stops_the_server(tmp_path: Path) -> None:
    """Ctrl-C while the server starts must not leave it running (it has its own session, so
    the terminal's SIGINT does not reach it)."""
    srv = EmbeddedServer(timeout=30)
    srv.argv = [sys.executable, "-c", "import time; time.sleep(60)"]

    def interrupt(elapsed: float) -> None:
        if elapsed > 0.5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        srv.start(on_poll=interrupt)
    assert srv.proc is not None and srv.proc.poll() is not None
