"""The agent side and the CLI import and run without torch, sglang or triton (core install)."""

from __future__ import annotations

import subprocess
import sys

BLOCK = (
    "import sys\n"
    "for name in ('torch', 'sglang', 'triton', 'transformers'):\n"
    "    sys.modules[name] = None  # any import of them now raises ImportError\n"
)


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCK + code], capture_output=True, text=True, timeout=120
    )


def test_cli_help_without_heavy_dependencies() -> None:
    r = run(
        "from typer.testing import CliRunner\n"
        "from leyline_agent.cli import app\n"
        "res = CliRunner().invoke(app, ['--help'])\n"
        "print(res.output); sys.exit(res.exit_code)\n"
    )
    assert r.returncode == 0, r.stderr
    for command in ("serve", "proxy", "replay", "trace"):
        assert command in r.stdout


def test_public_api_without_heavy_dependencies() -> None:
    r = run(
        "from leyline_agent import ConversationWrapper, Directive, Mode\n"
        "from leyline_agent.policies import parse_policy\n"
        "from leyline_agent.api import LeylineSession\n"
        "import leyline_agent.proxy.app, leyline_agent.traces, leyline_agent.kernels\n"
        "d = Directive(start=1, end=2, replacement=[7])\n"
        "print(d.apply([1, 2, 3]), parse_policy('stale_tool_outputs:keep_last=2'))\n"
    )
    assert r.returncode == 0, r.stderr
    assert "[1, 7, 3]" in r.stdout
