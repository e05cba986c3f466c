"""``launch.wait_healthy``: the one wait for ``/health`` that ``EmbeddedServer``, the proxy tests
and the proxy-overhead bench share (no sglang, no server: small Python processes)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from leyline_agent.backends.sglang.launch import ServerError, free_port, read_tail, wait_healthy

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
