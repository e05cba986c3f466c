"""mini-swe-agent 2.4.6, unmodified, through the Leyline proxy against SmolLM2-135M-Instruct served
for real (``leyline serve --model smollm2-135m-instruct``: real weights, fp32 on a CPU without bf16
units). No grammar: the model writes its own text, whatever it is (a 135M model rarely writes a
valid ``bash`` call; mini-swe-agent answers a reply without one with a format-error message and
the next call carries it). Asserted: every call went through the proxy into one session, each
call after the first found the previous prompt cached, the agent's requests were accepted
(no error, no splice error, the proxy's rendering equal to the server's prompt tokens), and the
answers were the model's own non-empty text. Few steps and short answers keep its CI cost small.
The server is the session's (``conftest.smollm2_server``)."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest
from test_mini_swe_agent import DRIVER, ensure_venv

# mini-swe-agent keeps a reply without a valid tool call only in the format-error message's
# ``extra.response`` (its history then holds no assistant message): print every reply's message
REPLIES = """
print(json.dumps({"replies": [m["extra"]["response"]["choices"][0]["message"]
                              for m in agent.messages
                              if isinstance(m.get("extra", {}).get("response"), dict)]}))
"""

pytestmark = [pytest.mark.sglang, pytest.mark.live]

MODEL = "smollm2-135m-instruct"
POLICY = "stale_tool_outputs:keep_last=1"
STEPS = 3


@pytest.fixture(scope="module")
def server(smollm2_server: str) -> str:
    """The session's SmolLM2 server (``conftest.smollm2_server``)."""
    return smollm2_server


@pytest.mark.timeout(1800)
def test_mini_swe_agent_with_real_text_through_the_proxy(server: str, tmp_path: Path) -> None:
    from leyline_agent.evals.debug_gym.backend import ProxyServer
    from leyline_agent.models import resolve

    python = ensure_venv()
    work = tmp_path / "repo"
    work.mkdir()
    (work / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    session = f"msa-smol-{uuid.uuid4().hex[:8]}"
    with ProxyServer(server, POLICY, splice=True, model_path=str(resolve(MODEL, None))) as proxy:
        spec = {
            "model": "openai/smollm2-135m-instruct",
            "cwd": str(work),
            "task": "calc.py: add(2, 3) returns -1 instead of 5. Fix it.",
            "step_limit": STEPS,
            "model_kwargs": {
                "api_base": f"{proxy.url}/v1",
                "api_key": "leyline",
                "temperature": 0.0,
                "max_tokens": 48,
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
        (tmp_path / "driver.py").write_text(DRIVER + REPLIES)
        run = subprocess.run(
            [str(python), str(tmp_path / "driver.py"), str(tmp_path / "spec.json")],
            capture_output=True, text=True, env=env, timeout=1500,
        )  # fmt: skip
        detail = proxy.session(session)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    *_, line, last = run.stdout.strip().splitlines()
    out, replies = json.loads(line), json.loads(last)["replies"]
    assert detail is not None, "the proxy has no record of the session"
    records = detail["records"]
    n = out["n_calls"]
    # a 135M model does not fix the bug in 3 steps: the step limit ends the run
    assert out["result"]["exit_status"] != "Submitted", out["result"]
    assert n == STEPS and len(records) == n, (n, records)
    # every call's reply is the model's own text (or a tool call); valid calls became assistant
    # messages, the others format-error messages (mini-swe-agent's own accounting)
    assert len(replies) == n
    assert all((m.get("content") or "").strip() or m.get("tool_calls") for m in replies), replies
    valid = [m for m in out["messages"] if m["role"] == "assistant"]
    assert len(valid) <= sum(bool(m.get("tool_calls")) for m in replies), (valid, replies)
    assert all(r["error"] is None and r["splice_error"] is None for r in records), records
    assert not any(r["render_mismatch"] for r in records), records
    assert records[0]["server_cached_tokens"] == 0
    for prev, r in zip(records, records[1:], strict=False):
        # the previous call's prompt is a prefix of this one's (mini-swe-agent appends)
        assert r["prompt_tokens"] > prev["prompt_tokens"] and r["server_cached_tokens"] > 0
        if not r["spliced"]:  # a spliced turn's cached prefix is the edited one
            # all of it but the generation prompt's "assistant\n" (the next turn's role differs)
            assert r["server_cached_tokens"] >= prev["prompt_tokens"] - 3, (prev, r)
        assert r["reused_tokens"] == r["best_reused_tokens"], r  # nothing the cache lost
        uncached = r["prompt_tokens"] - r["server_cached_tokens"]
        assert r["prefilled_tokens"] == uncached + r["splice_prefilled_tokens"], r
    spliced = [r for r in records if r["spliced"]]
    assert all(r["directives_amortize"] > 0 and r["splice_prefilled_tokens"] >= 0 for r in spliced)
