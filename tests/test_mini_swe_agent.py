"""mini-swe-agent 2.4.6, unmodified, through the Leyline proxy against a real ``leyline serve``.

mini-swe-agent pins litellm and an ``openai`` that SGLang's environment does not want, so it gets
its own venv (``$LEYLINE_CACHE/mini-swe-agent-2.4.6/venv``, created on first use from PyPI, then
reused). The run uses its ``DefaultAgent``, ``LitellmModel`` (tool calling, one ``bash`` tool),
``LocalEnvironment`` and its built-in ``default.yaml`` config. Random weights never write a valid
action, so the request body carries an ``ebnf`` grammar (litellm's ``extra_body``; the proxy
forwards unknown fields) that forces one ``bash`` call whose command keeps a step counter in the
work directory and submits (``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``) at its 5th run.
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

VERSION = "2.4.6"
POLICY = "stale_tool_outputs:keep_last=2"
STEPS = 5
COMMAND = (
    "n=$(cat .steps 2>/dev/null || echo 0); echo $((n+1)) > .steps; "
    f"if [ $n -ge {STEPS - 1} ]; then echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; "
    "else cat -n calc.py; fi"
)

DRIVER = r"""
import json, sys
from pathlib import Path

import yaml
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import builtin_config_dir
from minisweagent.environments.local import LocalEnvironment
from minisweagent.models.litellm_model import LitellmModel

spec = json.loads(Path(sys.argv[1]).read_text())
config = yaml.safe_load((builtin_config_dir / "default.yaml").read_text())
model_cfg = config["model"]
model_cfg["model_kwargs"] = {**model_cfg.get("model_kwargs", {}), **spec["model_kwargs"]}
model = LitellmModel(model_name=spec["model"], cost_tracking="ignore_errors", **model_cfg)
env = LocalEnvironment(**{**config.get("environment", {}), "cwd": spec["cwd"]})
agent = DefaultAgent(model, env, **{**config["agent"], "step_limit": spec["step_limit"]})
result = agent.run(spec["task"])
print(json.dumps({"result": result, "n_calls": agent.n_calls, "messages": [
    {k: v for k, v in m.items() if k != "extra"} for m in agent.messages
]}))
"""


def ensure_venv() -> Path:
    """The framework's own venv (``agent_venv.ensure_venv``); returns its python."""
    return agent_venv.ensure_venv("mini-swe-agent", VERSION, f"mini-swe-agent=={VERSION}")


def bash_grammar(command: str) -> str:
    """EBNF for exactly one ``bash`` tool call running ``command`` (SGLang's qwen25 format)."""
    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    assert call.startswith('{"name": ') and call.endswith("}")
    return f"root ::= {json.dumps(CALL_OPEN + call.removeprefix('{"name": ')[:-1] + CALL_CLOSE)}\n"


@pytest.mark.sglang
@pytest.mark.timeout(3600)
def test_mini_swe_agent_through_the_proxy(leyline_server: str, tmp_path: Path) -> None:
    from leyline_agent.evals.debug_gym.backend import ProxyServer

    python = ensure_venv()
    work = tmp_path / "repo"
    work.mkdir()
    (work / "calc.py").write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(40)))
    session = f"msa-{uuid.uuid4().hex[:8]}"
    with ProxyServer(leyline_server, POLICY, splice=True, model_path=None) as proxy:
        spec = {
            "model": "openai/leyline-embedded",
            "cwd": str(work),
            "task": "calc.py returns wrong values; find and fix the bug.",
            "step_limit": STEPS + 3,
            "model_kwargs": {
                "api_base": f"{proxy.url}/v1",
                "api_key": "leyline",
                "temperature": 0.0,
                "max_tokens": 160,
                "extra_body": {"ebnf": bash_grammar(COMMAND)},
                "extra_headers": {"X-Leyline-Session": session},
            },
        }
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        env = {
            **os.environ,
            "MSWEA_SILENT_STARTUP": "1",
            "MSWEA_GLOBAL_CONFIG_DIR": str(tmp_path / "mswea"),
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        }
        (tmp_path / "driver.py").write_text(DRIVER)
        run = subprocess.run(
            [str(python), str(tmp_path / "driver.py"), str(tmp_path / "spec.json")],
            capture_output=True, text=True, env=env, timeout=1800,
        )  # fmt: skip
        detail = proxy.session(session)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["result"]["exit_status"] == "Submitted", out["result"]
    assert out["n_calls"] == STEPS and (work / ".steps").read_text().strip() == str(STEPS)
    tool_msgs = [m for m in out["messages"] if m["role"] == "tool"]
    assert len(tool_msgs) == STEPS - 1 and all(m["tool_call_id"] for m in tool_msgs)
    records = detail["records"]
    assert len(records) == STEPS  # one session, every call through the proxy
    # call k (1-based) holds k - 1 steps; keep_last=2 stubs step s once k - 1 >= s + 2
    policy_edits = [k for k in range(1, STEPS + 1) if k - 1 >= 3]
    spliced = [i + 1 for i, r in enumerate(records) if r.get("spliced")]
    assert spliced == policy_edits == [4, 5], records
    assert all(r.get("splice_error") is None for r in records)
