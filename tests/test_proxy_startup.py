"""``leyline proxy`` says where it listens, its backend and its policy when it starts."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from leyline_agent.backends.sglang.launch import free_port, read_tail, wait_healthy


def test_the_start_up_line_names_backend_and_policy() -> None:
    port, backend = free_port(), f"http://127.0.0.1:{free_port()}"  # no backend there: fine
    argv = [sys.executable, "-m", "leyline_agent.cli", "proxy", "--port", str(port),
            "--backend", backend, "--policy", "stale_tool_outputs:keep_last=2", "--no-splice"]  # fmt: skip
    log = Path(tempfile.mkstemp(prefix="leyline-proxy-", suffix=".log")[1])
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, 60, name="leyline proxy", log_tail=lambda: read_tail(log))
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    assert (
        f"leyline proxy on {url}/v1: backend {backend}, policy stale_tool_outputs:keep_last=2, "
        "no splices (--no-splice: edits re-prefilled)"
    ) in log.read_text().splitlines()
