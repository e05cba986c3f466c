"""Trace loaders: SWE-agent .traj, debug-gym logs, OpenAI-message JSONL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from shared_data import traces_dir

from leyline_agent.policies import is_observation
from leyline_agent.traces import TraceFormatError, load


def swe_files() -> list[Path]:
    return sorted((traces_dir() / "swe-agent").glob("*.traj"))


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
