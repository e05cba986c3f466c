"""Trace loaders: SWE-agent .traj, debug-gym logs, OpenAI-message JSONL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from shared_data import REPO, shared_dir, traces_dir

from leyline_agent.policies import is_observation
from leyline_agent.traces import TraceFormatError, load

REPO_TRACES = REPO / "experiments" / "traces"


def swe_files() -> list[Path]:
    """The SWE-agent trajectories kept in the repository, plus the shared ones where present."""
    shared = shared_dir("traces")
    extra = sorted((shared / "swe-agent").glob("*.traj")) if shared else []
    return sorted((REPO_TRACES / "swe-agent").glob("*.traj")) + extra


def check_prefix_growth(turns: list[list[dict]]) -> None:
    for a, b in zip(turns, turns[1:], strict=False):
        assert b[: len(a)] == a and len(b) > len(a)


def test_swe_agent_traj() -> None:
    files = swe_files()
    assert files
    for path in files:
        raw = json.loads(path.read_text())["history"]
        (trace,) = load(path)
        assert trace.name == path.stem and trace.source == str(path) and trace.tools is None
        actions = [i for i, m in enumerate(raw) if m["role"] == "assistant" and i > 0]
        assert len(trace.turns) == len(actions)
        assert [len(t) for t in trace.turns] == actions  # the request before each action
        check_prefix_growth(trace.turns)
        last = trace.turns[-1]
        assert [m["content"] for m in last] == [m["content"] for m in raw[: len(last)]]
        first_action = next(i for i, m in enumerate(raw) if m["role"] == "assistant")
        for i, (m, r) in enumerate(zip(last, raw, strict=False)):
            assert set(m) <= {
                "role",
                "content",
                "tool_calls",
                "tool_call_id",
                "name",
                "leyline_observation",
            }
            answers_action = r["role"] in ("user", "tool") and i > first_action
            assert is_observation(m) == answers_action, (path.name, i)
            if r["role"] == "tool":
                assert m["tool_call_id"] == r["tool_call_ids"][0]
            if r.get("tool_calls"):
                assert [c["function"]["name"] for c in m["tool_calls"]] == [
                    c["function"]["name"] for c in r["tool_calls"]
                ]
                assert all(isinstance(c["function"]["arguments"], str) for c in m["tool_calls"])


def test_text_based_traj_flags_user_observations() -> None:
    text_based = [
        p
        for p in swe_files()
        if not any(m.get("tool_calls") for m in json.loads(p.read_text())["history"])
    ]
    if not text_based:
        pytest.skip("no text-based SWE-agent trajectory among the shared traces")
    (trace,) = load(text_based[0])
    last = trace.turns[-1]
    flagged = [m for m in last if m.get("leyline_observation")]
    assert flagged and all(m["role"] == "user" for m in flagged)
    assert not any(
        m.get("leyline_observation")
        for m in last[: next(i for i, m in enumerate(last) if m["role"] == "assistant")]
    )


def test_repository_traces_load() -> None:
    """experiments/traces: 19 sessions with distinct names (the fidelity bench keys cases by
    name), every file loaded, only the README and LICENSE skipped; text-based and
    function-calling runs both give observations that the stale-output policy can stub."""
    traces = load(REPO_TRACES)
    assert len(traces) == 19 and len({t.name for t in traces}) == 19
    assert sorted(Path(s.path).name for s in traces.skipped) == ["LICENSE", "README.md"]
    turns = {t.name: len(t.turns) for t in traces}
    assert turns["ctf-web-i_got_id_demo"] == 21 and turns["pydicom-1458"] == 12
    for t in traces:
        check_prefix_growth(t.turns)
        obs = [m for m in t.turns[-1] if is_observation(m)]
        assert obs, t.name
        assert {m["role"] for m in obs} == (
            {"tool"}
            if t.name.startswith(("marshmallow-1867.function_calling", "sweagenttestrepo"))
            else {"user"}
        ), t.name


def test_debug_gym_log() -> None:
    path = next((traces_dir() / "debug-gym").glob("*.json"))
    data = json.loads(path.read_text())
    (trace,) = load(path)
    pairs = [p for s in data["log"] for p in s.get("prompt_response_pairs") or []]
    assert len(trace.turns) == len(pairs)
    assert trace.tools == data["tools"]
    for turn, pair in zip(trace.turns, pairs, strict=True):
        assert [m["role"] for m in turn] == [m["role"] for m in pair["prompt"]]
        assert [m["content"] for m in turn] == [m["content"] for m in pair["prompt"]]
    tool_msgs = [m for m in trace.turns[-1] if m["role"] == "tool"]
    assert tool_msgs and all(m["tool_call_id"] and m["name"] for m in tool_msgs)


def test_directory_reads_every_trace() -> None:
    root = traces_dir()
    traces = load(root)
    files = sorted(p for p in root.rglob("*") if p.suffix in (".traj", ".json", ".jsonl"))
    assert sorted(t.source for t in traces) == sorted(map(str, files))
    assert all(t.turns for t in traces)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_one_request_per_line(tmp_path: Path) -> None:
    t1 = [{"role": "user", "content": "hi"}]
    t2 = [*t1, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    (trace,) = load(write_jsonl(tmp_path / "run.jsonl", [t1, {"messages": t2, "tools": tools}]))
    assert trace.turns == [t1, t2] and trace.tools == tools and trace.name == "run"


def test_jsonl_one_message_per_line(tmp_path: Path) -> None:
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a1"},
        {"role": "tool", "content": "t1", "tool_call_id": "x"},
        {"role": "assistant", "content": "a2"},
    ]
    (trace,) = load(write_jsonl(tmp_path / "m.jsonl", [{"tools": []}, *msgs]))
    assert [len(t) for t in trace.turns] == [2, 4]
    with_turns = [{**m, "turn": t} for m, t in zip(msgs, [0, 0, 1, 1, 2], strict=True)]
    (trace,) = load(write_jsonl(tmp_path / "t.jsonl", with_turns))
    assert [len(t) for t in trace.turns] == [2, 4, 5]
    assert all("turn" not in m for t in trace.turns for m in t)


def test_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "missing.traj")
    mixed = write_jsonl(
        tmp_path / "mixed.jsonl",
        [[{"role": "user", "content": "a"}], {"role": "user", "content": "b"}],
    )
    with pytest.raises(TraceFormatError, match="mixes"):
        load(mixed)
    other = tmp_path / "other.json"
    other.write_text('{"something": 1}')
    with pytest.raises(TraceFormatError, match="not a SWE-agent"):
        load(other)
    (tmp_path / "README.md").write_text("not a trace")
    assert load(tmp_path) == []  # directories skip files that are no trace


SYSTEM = "Your goal is to debug a Python program to make sure it can pass a set of test functions."
TASK = "The program doesn't behave as intended. Investigate the repository, then fix the issue."
ACTIONS = [
    ("eval", {}, "FAILED test.py::test_counter - AssertionError: assert 2 == 3"),
    ("view", {"path": "test.py"}, "     1 from counter_code import count\n     2 ..."),
    ("view", {"path": "counter_code.py"}, "     1 def count(xs):\n     2     return len(xs) - 1"),
    ("listdir", {}, "/testbed/\n|-- counter_code.py\n|-- test.py"),
    ("eval", {}, "FAILED test.py::test_counter - AssertionError: assert 2 == 3"),
]


def anthropic_log(steps: int = 5) -> dict:
    """A debug-gym log as its ``AnthropicLLM`` writes it (modelled on the shared debug-gym log):
    ``steps`` model calls; call ``k`` sent the system prompt, the task and ``k`` earlier actions,
    each an assistant ``text`` + ``tool_use`` message answered by a user ``tool_result``."""
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    log = [{"step_id": 0, "action": None, "obs": TASK, "prompt_response_pairs": None}]
    for k in range(steps):
        name, args, obs = ACTIONS[k]
        call_id = f"toolu_01{k:022d}"
        tool = {"id": call_id, "name": name, "arguments": args}
        pair = {"prompt": [dict(m) for m in history], "response": "", "tool": tool}
        log.append({"step_id": k + 1, "action": tool, "obs": obs, "prompt_response_pairs": [pair]})
        history.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": f"Step {k}: call {name}."},
                    {"type": "tool_use", "id": call_id, "name": name, "input": args},
                ],
            }
        )
        history.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call_id, "content": obs}],
            }
        )
    schema = {"type": "object", "properties": {"path": {"type": "string"}}}
    tools = [
        {"name": n, "description": f"the {n} tool", "input_schema": schema}
        for n in ("eval", "view", "listdir")
    ]
    return {"problem": "counter", "tools": tools, "uuid": "u", "success": False, "log": log}


def test_debug_gym_anthropic_log(tmp_path: Path) -> None:
    path = tmp_path / "counter.json"
    path.write_text(json.dumps(anthropic_log()))
    (trace,) = load(path)
    assert [len(t) for t in trace.turns] == [2, 4, 6, 8, 10]
    check_prefix_growth(trace.turns)
    last = trace.turns[-1]
    assert [m["role"] for m in last] == ["system", "user"] + ["assistant", "tool"] * 4
    for k, (assistant, tool) in enumerate(zip(last[2::2], last[3::2], strict=True)):
        name, args, obs = ACTIONS[k]
        (call,) = assistant["tool_calls"]
        assert call["id"] == f"toolu_01{k:022d}" and call["function"]["name"] == name
        assert json.loads(call["function"]["arguments"]) == args
        assert isinstance(call["function"]["arguments"], str)
        assert assistant["content"] == f"Step {k}: call {name}."
        assert tool == {"role": "tool", "content": obs, "tool_call_id": call["id"], "name": name}
        assert is_observation(tool)
    assert [t["function"]["name"] for t in trace.tools] == ["eval", "view", "listdir"]
    assert trace.tools[1]["function"]["parameters"]["properties"] == {"path": {"type": "string"}}


def test_trace_check_edits_anthropic_tool_results(tmp_path: Path) -> None:
    """stale_tool_outputs:keep_last=2 stubs step s's output once the prompt holds s + 2 actions.
    The 5 prompts hold 0..4 actions, so the prompts with 3 and 4 actions each evict one more
    output: 2 edited turns, 1 directive each (when tool results were read as empty user
    messages, nothing was an observation and the check reported 0)."""
    from typer.testing import CliRunner

    from leyline_agent.cli import app

    (tmp_path / "counter.json").write_text(json.dumps(anthropic_log()))
    (tmp_path / "notes.md").write_text("not a trace")
    (tmp_path / "broken.json").write_text('{"log": 3}')
    result = CliRunner().invoke(
        app, ["trace", "check", str(tmp_path), "--policy", "stale_tool_outputs:keep_last=2"]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary == {
        "traces": 1,
        "turns": 5,
        "edited_turns": 2,
        "directives": 2,
        "fallback": 0,
        "errors": 0,
    }
    assert f"skipped {tmp_path / 'notes.md'}: not a .traj/.json/.jsonl file" in result.output
    assert f"skipped {tmp_path / 'broken.json'}: not a SWE-agent .traj" in result.output


def test_directory_names_every_file_it_skips(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "run.json").write_text(json.dumps(anthropic_log(2)))
    (tmp_path / "LICENSE").write_text("MIT")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "no_calls.traj").write_text(
        json.dumps({"history": [{"role": "user", "content": "x"}]})
    )
    blocks = [{"role": "assistant", "content": [{"type": "audio", "data": "..."}]}]
    (tmp_path / "odd.jsonl").write_text(json.dumps(blocks) + "\n")
    traces = load(tmp_path)
    assert [t.name for t in traces] == ["run"]
    reasons = {Path(p).name: r for p, r in traces.skipped}
    assert reasons.keys() == {"LICENSE", "bad.jsonl", "empty.jsonl", "no_calls.traj", "odd.jsonl"}
    assert reasons["LICENSE"] == "not a .traj/.json/.jsonl file"
    assert reasons["bad.jsonl"].startswith(f"{tmp_path / 'bad.jsonl'}:1: not JSON")
    assert reasons["empty.jsonl"] == reasons["no_calls.traj"] == "no model call recorded"
    assert "unknown content blocks ['audio']" in reasons["odd.jsonl"]
    with pytest.raises(TraceFormatError, match="no model call recorded"):
        load(tmp_path / "empty.jsonl")  # a single file raises instead


def test_anthropic_blocks_in_jsonl(tmp_path: Path) -> None:
    """One message per line, Anthropic blocks: a tool_result line becomes tool messages (plus a
    user message for the line's text) and keeps its turn."""
    rows = [
        {"role": "user", "content": "fix it", "turn": 0},
        {"role": "assistant", "turn": 1, "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "s"},
            {"type": "tool_use", "id": "a", "name": "view", "input": {"path": "x.py"}},
            {"type": "tool_use", "id": "b", "name": "eval", "input": {}},
        ]},
        {"role": "user", "turn": 1, "content": [
            {"type": "tool_result", "tool_use_id": "a", "content": [{"type": "text", "text": "1"}]},
            {"type": "tool_result", "tool_use_id": "b", "content": "ok"},
            {"type": "text", "text": "go on"},
        ]},
    ]  # fmt: skip
    (trace,) = load(write_jsonl(tmp_path / "a.jsonl", rows))
    assert [len(t) for t in trace.turns] == [1, 5]
    _, assistant, t1, t2, user = trace.turns[-1]
    assert assistant["content"] is None and [c["id"] for c in assistant["tool_calls"]] == ["a", "b"]
    assert t1 == {"role": "tool", "content": "1", "tool_call_id": "a", "name": "view"}
    assert t2 == {"role": "tool", "content": "ok", "tool_call_id": "b", "name": "eval"}
    assert user == {"role": "user", "content": "go on"}


@pytest.mark.parametrize("name,indent", [("debug_gym.jsonl", 4), ("froggy.jsonl", None)])
def test_old_debug_gym_jsonl_holding_one_document(
    tmp_path: Path, name: str, indent: int | None
) -> None:
    """debug-gym before PR #230 wrote its log as ONE JSON document into a .jsonl file (pretty-
    printed or on one line): loaded as the same trace as the .json, named after its problem."""
    src = next((traces_dir() / "debug-gym").glob("*.json"))
    data = json.loads(src.read_text())
    run = tmp_path / "run-1" / data["problem"]
    run.mkdir(parents=True)
    (run / name).write_text(json.dumps(data, indent=indent))
    traces = load(tmp_path)
    assert traces.skipped == []
    (trace,) = traces
    (ref,) = load(src)
    assert trace.name == data["problem"]
    assert trace.turns == ref.turns and trace.tools == ref.tools and len(trace.turns) > 1
    assert trace.source == str(run / name)
