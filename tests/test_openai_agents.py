"""The OpenAI Agents SDK 0.24.0, unmodified, in its default Responses mode (``OpenAIResponsesModel``
over ``POST /v1/responses``), through the Leyline proxy against a real ``leyline serve``.

The SDK pins an ``openai`` and ``pydantic`` that SGLang's environment does not want, so it gets its
own venv (``$LEYLINE_CACHE/openai-agents-0.24.0/venv``, created on first use from PyPI, then
reused). Random weights never write a valid call, so ``ModelSettings.extra_body`` carries an
``ebnf`` grammar (the proxy sends unknown fields on to SGLang) that forces one ``read_file`` call
per model turn; the agent's ``tool_use_behavior`` ends the run after the ``STEPS``-th call.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import agent_venv
import pytest

from leyline_agent.evals.debug_gym.grammar import CALL_CLOSE, CALL_OPEN

VERSION = "0.24.0"
POLICY = "stale_tool_outputs:keep_last=2"
STEPS = 5

DRIVER = r"""
import asyncio, json, sys
from pathlib import Path

from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client
from agents import set_tracing_disabled
from agents.agent import ToolsToFinalOutputResult
from openai import AsyncOpenAI

spec = json.loads(Path(sys.argv[1]).read_text())
set_tracing_disabled(True)
set_default_openai_client(AsyncOpenAI(base_url=spec["base_url"], api_key="leyline",
    default_headers={"X-Leyline-Session": spec["session"]}), use_for_tracing=False)
calls = []

@function_tool
def read_file(path: str) -> str:
    "Print a file with line numbers."
    calls.append(path)
    n = len(calls)
    return "\n".join(f"{i:4d}  def helper_{n}_{i}(x):  return x * {i} + {n}" for i in range(1, 16))

def stop_after(ctx, results):
    done = len(calls) >= spec["steps"]
    return ToolsToFinalOutputResult(is_final_output=done,
                                    final_output=f"read {len(calls)} files" if done else None)

agent = Agent(name="debugger", instructions="Find the bug. Use the tools.", tools=[read_file],
              model=spec["model"], tool_use_behavior=stop_after,
              model_settings=ModelSettings(temperature=0.0, max_tokens=96,
                                           extra_body={"ebnf": spec["ebnf"]}))
result = asyncio.run(Runner.run(agent, "tests/test_calc.py fails.", max_turns=spec["steps"] + 2))
print(json.dumps({"final": result.final_output, "calls": calls,
                  "responses": [r.response_id for r in result.raw_responses]}))
"""


def ensure_venv() -> Path:
    """The framework's own venv (``agent_venv.ensure_venv``); returns its python."""
    return agent_venv.ensure_venv("openai-agents", VERSION, f"openai-agents=={VERSION}")


def read_file_grammar(path: str) -> str:
    """EBNF for exactly one ``read_file`` call (SGLang's qwen25 tool-call format)."""
    call = json.dumps({"name": "read_file", "arguments": {"path": path}})
    return f"root ::= {json.dumps(CALL_OPEN + call.removeprefix('{"name": ')[:-1] + CALL_CLOSE)}\n"


@pytest.mark.sglang
@pytest.mark.timeout(1800)
def test_openai_agents_sdk_in_responses_mode_through_the_proxy(
    leyline_server: str, tmp_path: Path
) -> None:
    from leyline_agent.evals.debug_gym.backend import ProxyServer

    python = ensure_venv()
    session = f"agents-{uuid.uuid4().hex[:8]}"
    with ProxyServer(leyline_server, POLICY, splice=True, model_path=None) as proxy:
        spec = {
            "base_url": f"{proxy.url}/v1", "session": session, "model": "leyline-embedded",
            "steps": STEPS, "ebnf": read_file_grammar("src/calc.py"),
        }  # fmt: skip
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        (tmp_path / "driver.py").write_text(DRIVER)
        env = {**os.environ, "OPENAI_AGENTS_DISABLE_TRACING": "1"}
        run = subprocess.run(
            [str(python), str(tmp_path / "driver.py"), str(tmp_path / "spec.json")],
            capture_output=True, text=True, env=env, timeout=1200,
        )  # fmt: skip
        detail = proxy.session(session)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["final"] == f"read {STEPS} files" and out["calls"] == ["src/calc.py"] * STEPS
    assert len(out["responses"]) == STEPS and all(r.startswith("resp_") for r in out["responses"])
    records = detail["records"]
    assert len(records) == STEPS  # one session: every model call through /v1/responses
    # call k (1-based) holds k - 1 tool outputs; keep_last=2 stubs output s once k - 1 >= s + 2
    spliced = [i + 1 for i, r in enumerate(records) if r.get("spliced")]
    assert spliced == [k for k in range(1, STEPS + 1) if k - 1 >= 3] == [4, 5], records
    assert not any(r["render_mismatch"] or r["splice_error"] for r in records), records
    assert all(r["reused_tokens"] > 0 for r in records[1:])
