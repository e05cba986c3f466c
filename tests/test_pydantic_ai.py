"""pydantic-ai (``pydantic-ai-slim[openai]``), unmodified, with its ``OpenAIChatModel`` (Chat
Completions) through the Leyline proxy against a real ``leyline serve``: a framework the other
tests do not use, in its own venv (``$LEYLINE_CACHE/pydantic-ai-slim-VERSION/venv``, created on
first use from PyPI). Random weights never write a valid call, so the model settings'
``extra_body`` carries an ``ebnf`` grammar that forces one ``read_file`` call per model request;
the run ends at ``UsageLimits(request_limit=STEPS)`` (pydantic-ai raises ``UsageLimitExceeded``
before sending request ``STEPS + 1``).
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import agent_venv
import pytest
from test_openai_agents import read_file_grammar

VERSION = "2.68.0"
POLICY = "stale_tool_outputs:keep_last=2"
STEPS = 5

DRIVER = r"""
import json, sys
from pathlib import Path

from pydantic_ai import Agent
from pydantic_ai.exceptions import UsageLimitExceeded
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import UsageLimits

spec = json.loads(Path(sys.argv[1]).read_text())
model = OpenAIChatModel(spec["model"],
                        provider=OpenAIProvider(base_url=spec["base_url"], api_key="leyline"))
agent = Agent(model, instructions="Find the bug. Use the tools.", model_settings={
    "temperature": 0.0, "max_tokens": 96, "extra_body": {"ebnf": spec["ebnf"]},
    "extra_headers": {"X-Leyline-Session": spec["session"]}})
calls = []

@agent.tool_plain
def read_file(path: str) -> str:
    "Print a file with line numbers."
    calls.append(path)
    n = len(calls)
    return "\n".join(f"{i:4d}  def helper_{n}_{i}(x):  return x * {i} + {n}" for i in range(1, 16))

try:
    agent.run_sync("tests/test_calc.py fails.",
                   usage_limits=UsageLimits(request_limit=spec["steps"]))
    status = "finished"
except UsageLimitExceeded as e:
    status = "request_limit"
print(json.dumps({"status": status, "calls": calls}))
"""


def ensure_venv() -> Path:
    """The framework's own venv (``agent_venv.ensure_venv``); returns its python."""
    return agent_venv.ensure_venv(
        "pydantic-ai-slim", VERSION, f"pydantic-ai-slim[openai]=={VERSION}"
    )


@pytest.mark.sglang
@pytest.mark.timeout(1800)
def test_pydantic_ai_through_the_proxy(leyline_server: str, tmp_path: Path) -> None:
    from leyline_agent.evals.debug_gym.backend import ProxyServer

    python = ensure_venv()
    session = f"pydantic-ai-{uuid.uuid4().hex[:8]}"
    with ProxyServer(leyline_server, POLICY, splice=True, model_path=None) as proxy:
        spec = {
            "base_url": f"{proxy.url}/v1", "session": session, "model": "leyline-embedded",
            "steps": STEPS, "ebnf": read_file_grammar("src/calc.py"),
        }  # fmt: skip
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        (tmp_path / "driver.py").write_text(DRIVER)
        run = subprocess.run(
            [str(python), str(tmp_path / "driver.py"), str(tmp_path / "spec.json")],
            capture_output=True, text=True, timeout=1200,
        )  # fmt: skip
        detail = proxy.session(session)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out == {"status": "request_limit", "calls": ["src/calc.py"] * STEPS}
    records = detail["records"]
    assert len(records) == STEPS  # one session: every model request through the proxy
    # request k (1-based) holds k - 1 tool outputs; keep_last=2 stubs output s once k - 1 >= s + 2
    spliced = [i + 1 for i, r in enumerate(records) if r.get("spliced")]
    assert spliced == [k for k in range(1, STEPS + 1) if k - 1 >= 3] == [4, 5], records
    assert not any(r["render_mismatch"] or r["splice_error"] for r in records), records
    assert all(r["reused_tokens"] > 0 for r in records[1:])
