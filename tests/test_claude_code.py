"""The Claude Code CLI (``@anthropic-ai/claude-code`` 2.1.328 from npm, its native Linux binary),
unmodified, through the Leyline proxy's ``POST /v1/messages`` against a real ``leyline serve``.

Installed on first use into ``$LEYLINE_CACHE/claude-code-2.1.328`` (``npm install``), pointed at
the proxy with ``ANTHROPIC_BASE_URL`` and a dummy key, in non-interactive mode (``claude -p``),
then resumed (``--resume``) for a second prompt in the same conversation. With random weights its
replies are noise: ``CLAUDE_CODE_MAX_OUTPUT_TOKENS=8`` keeps them short, and Claude Code ends each
run with its own "exceeded the 8 output token maximum" error after retrying. Checked: the
protocol (its streamed requests answered, its JSON result), one session named by its
``X-Claude-Code-Session-Id``, and the cache (every request after the first prefills only its
new tail; no render mismatch).
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from leyline_agent.cache import cache_root

VERSION = "2.1.328"
POLICY = "stale_tool_outputs:keep_last=2"


def ensure_cli() -> Path:
    """Claude Code's native binary (installed once from npm: about 370 MB)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        pytest.fail(f"this test runs Claude Code's linux-x64 binary, not {platform.machine()}")
    root = cache_root() / f"claude-code-{VERSION}"
    binary = root / "node_modules" / "@anthropic-ai" / "claude-code-linux-x64" / "claude"
    stamp = root / ".leyline-installed"
    if stamp.is_file() and binary.is_file():
        return binary
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".install.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (stamp.is_file() and binary.is_file()):
            subprocess.run(
                ["npm", "install", "--prefix", str(root), "--no-audit", "--no-fund",
                 f"@anthropic-ai/claude-code@{VERSION}"],
                check=True, capture_output=True, timeout=900,
            )  # fmt: skip
            stamp.write_text(VERSION + "\n")
    return binary


def claude(binary: Path, proxy: str, home: Path, *args: str) -> dict[str, Any]:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))},
        "HOME": str(home), "ANTHROPIC_BASE_URL": proxy, "ANTHROPIC_API_KEY": "leyline-dummy",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "8", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }  # fmt: skip
    run = subprocess.run(
        [str(binary), "-p", *args, "--output-format", "json"],
        cwd=home / "work", env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.stdout.strip(), run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.sglang
@pytest.mark.timeout(1800)
def test_claude_code_through_the_proxy(leyline_server: str, tmp_path: Path) -> None:
    from leyline_agent.evals.debug_gym.backend import ProxyServer

    binary = ensure_cli()
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    with ProxyServer(leyline_server, POLICY, splice=True, model_path=None) as proxy:
        first = claude(binary, proxy.url, tmp_path, "calc.py is wrong. Fix it.")
        sid = first["session_id"]
        after_first = proxy.session(f"cache_key:{quote('claude-code:' + sid, safe='')}")
        second = claude(binary, proxy.url, tmp_path, "And the tests?", "--resume", sid)
        detail = proxy.session(f"cache_key:{quote('claude-code:' + sid, safe='')}")
    for result in (first, second):  # the protocol held: Claude Code's own verdict on noise
        assert result["type"] == "result" and result.get("api_error_status") is None, result
        assert "exceeded the 8 output token maximum" in result["result"], result
    assert second["session_id"] == sid
    records, n1 = detail["records"], len(after_first["records"])
    assert n1 >= 1 and len(records) > n1  # one session for both runs
    assert not any(r["render_mismatch"] or r["error"] for r in records), records
    assert records[0]["prompt_tokens"] > 5000  # Claude Code's system prompt and tools
    for r in records[1:]:  # each later request prefills only its new tail
        assert r["prefilled_tokens"] < 0.1 * r["prompt_tokens"], records
    resumed = records[n1]  # the first request of the resumed run carries the whole history
    assert resumed["prompt_tokens"] > records[n1 - 1]["prompt_tokens"]
    assert resumed["reused_tokens"] > 0.9 * records[n1 - 1]["prompt_tokens"]
