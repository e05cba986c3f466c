"""Policies: the built-ins, edits, the registry and spec parsing (no tokenizer needed)."""

from __future__ import annotations

import re
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from leyline_agent import Mode
from leyline_agent.policies import (
    Conversation,
    Edit,
    ObservationWindow,
    PolicyError,
    Redact,
    StaleToolOutputs,
    TokenBudget,
    apply_edits,
    available_policies,
    get_policy,
    parse_policy,
    register_policy,
)
from leyline_agent.policies import registry as policy_registry


def agent_run(steps: list[int], text_agent: bool = False) -> list[dict]:
    """system, task, then per step an assistant message with ``k`` tool outputs (``steps[i]``)."""
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    for s, k in enumerate(steps):
        calls = [
            {"id": f"c{s}.{j}", "function": {"name": "f", "arguments": "{}"}} for j in range(k)
        ]
        msgs.append({"role": "assistant", "content": f"act {s}", "tool_calls": calls})
        for j in range(k):
            out = f"out {s}.{j}\n" + "x\n" * (s + j)
            if text_agent:
                msgs.append({"role": "user", "content": out, "leyline_observation": True})
            else:
                msgs.append({"role": "tool", "tool_call_id": f"c{s}.{j}", "content": out})
    return msgs


def conv(messages: list[dict], counts: list[int] | None = None) -> Conversation:
    counts = counts or [len(m["content"] or "") for m in messages]
    return Conversation(messages, counts, count_tokens=len)


def edited(messages: list[dict], policy) -> list[dict]:  # noqa: ANN001
    return apply_edits(messages, policy(conv(messages))).messages


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict:
    """A private copy of the registry, so tests can register names."""
    copy = dict(policy_registry._REGISTRY)  # noqa: SLF001
    monkeypatch.setattr(policy_registry, "_REGISTRY", copy)
    return copy


def test_none() -> None:
    assert get_policy("none")(conv(agent_run([1, 1]))) == []
    assert parse_policy(None)(conv(agent_run([1]))) == [] == parse_policy("")(conv([]))


def test_conversation_view() -> None:
    msgs = agent_run([2, 1], text_agent=True)
    c = conv(msgs)
    assert c.observations == (3, 4, 6)
    assert c.steps == (0, 0, 0, 1, 1, 1, 2)
    assert c.num_steps == 2 and c.observation_groups() == [[3, 4], [6]]
    assert c.total_tokens == sum(len(m["content"]) for m in msgs)
    with pytest.raises(ValueError, match="token counts"):
        Conversation(msgs, [1])


@pytest.mark.parametrize("text_agent", [False, True], ids=["tool_role", "user_observations"])
def test_stale_tool_outputs(text_agent: bool) -> None:
    msgs = agent_run([1, 2, 1, 1], text_agent=text_agent)
    out = edited(msgs, StaleToolOutputs(keep_last=2))
    contents = [m["content"] for m in out]
    # steps 0 and 1 are stale: one stub per step, {n} = outputs of the step
    assert contents[3] == "[evicted: 1 old tool outputs]"
    assert contents[5:7] == ["[evicted: 2 old tool outputs]", ""]
    assert contents[8] == msgs[8]["content"] and contents[10] == msgs[10]["content"]
    assert [m["role"] for m in out] == [m["role"] for m in msgs]  # every call keeps its answer
    assert edited(msgs, StaleToolOutputs(keep_last=10)) == msgs
    every = edited(msgs, StaleToolOutputs(keep_last=0, stub="<{n}>"))
    assert [m["content"] for m in every if m["role"] != "assistant"][2:] == [
        "<1>",
        "<2>",
        "",
        "<1>",
        "<1>",
    ]
    with pytest.raises(ValueError, match="placeholder"):
        StaleToolOutputs(stub="{m}")


@given(st.lists(st.integers(1, 3), min_size=1, max_size=8), st.integers(0, 4))
def test_stale_stubs_never_change_once_written(steps: list[int], keep_last: int) -> None:
    policy = StaleToolOutputs(keep_last=keep_last)
    before = edited(agent_run(steps[:-1]), policy)
    after = edited(agent_run(steps), policy)
    for old, new in zip(before, after, strict=False):
        if old["content"] != new["content"]:  # only verbatim outputs may become stubs
            assert (new["role"] == "tool" and "evicted" in new["content"]) or new["content"] == ""
            assert "evicted" not in old["content"]


def test_token_budget() -> None:
    msgs = agent_run([1, 1, 2, 1])
    counts = [100] * len(msgs)
    c = conv(msgs, counts)
    stub_len = len("[evicted: 1 old tool outputs]")
    assert TokenBudget(max_tokens=c.total_tokens)(c) == []
    one = TokenBudget(max_tokens=c.total_tokens - 1)(c)
    assert [e.index for e in one] == [3]  # the oldest output only
    need = c.total_tokens - 2 * (100 - stub_len)  # exactly two single-output steps' worth
    assert [e.index for e in TokenBudget(max_tokens=need)(c)] == [3, 5]
    everything = TokenBudget(max_tokens=0)(c)
    assert [e.index for e in everything] == list(c.observations)
    assert {e.mode for e in everything} == {Mode.AMORTIZE}


def test_observation_window() -> None:
    msgs = agent_run([1, 2, 1], text_agent=True)
    out = edited(msgs, ObservationWindow(n=2))
    obs = [i for i, m in enumerate(msgs) if m.get("leyline_observation")]
    for i in obs[:-2]:
        lines = len(msgs[i]["content"].splitlines())
        assert out[i]["content"] == f"Old environment output: ({lines} lines omitted)"
    for i in obs[-2:]:
        assert out[i] == msgs[i]
    assert edited(msgs, ObservationWindow(n=0))[obs[-1]]["content"].startswith("Old environment")


def test_redact() -> None:
    msgs = [
        {"role": "system", "content": "key sk-abc123 and sk-zz"},
        {"role": "user", "content": "password=hunter2 sk-q"},
        {"role": "assistant", "content": None},
    ]
    policy = Redact(patterns=[r"sk-\w+", r"password=\S+", r"hunter2 sk"])
    edits = policy(conv(msgs))
    assert {e.mode for e in edits} == {Mode.FORGET}
    out = apply_edits(msgs, edits).messages
    assert out[0]["content"] == "key [redacted] and [redacted]"
    assert out[1]["content"] == "[redacted]"  # overlapping matches merged
    only_user = Redact(patterns=[r"sk-\w+"], roles=["user"])(conv(msgs))
    assert {e.index for e in only_user} == {1}
    with pytest.raises(ValueError, match="not a regular expression"):
        Redact(patterns=["(unclosed"])


def test_apply_edits_rules() -> None:
    msgs = [{"role": "user", "content": "0123456789"}, {"role": "tool", "content": "t"}]
    res = apply_edits(
        msgs,
        [
            Edit(index=0, span=(2, 4), replacement="AB"),
            Edit(index=0, span=(6, 6), replacement="+", mode=Mode.FORGET),
            Edit(index=1, replacement=None),
        ],
    )
    assert res.messages == [{"role": "user", "content": "01AB45+6789"}]
    assert res.sources == [0] and res.modes == {0: Mode.FORGET, 1: Mode.AMORTIZE}
    assert msgs[0]["content"] == "0123456789"  # input untouched
    with pytest.raises(PolicyError, match="overlapping"):
        apply_edits(
            msgs,
            [
                Edit(index=0, span=(1, 5), replacement=""),
                Edit(index=0, span=(4, 6), replacement=""),
            ],
        )
    with pytest.raises(PolicyError, match="2 messages"):
        apply_edits(msgs, [Edit(index=2, replacement="")])
    with pytest.raises(PolicyError, match="past"):
        apply_edits(msgs, [Edit(index=1, span=(0, 5), replacement="")])
    with pytest.raises(PolicyError, match="combined"):
        apply_edits(
            msgs, [Edit(index=1, replacement="a"), Edit(index=1, span=(0, 1), replacement="")]
        )
    with pytest.raises(ValueError, match="span edit needs"):
        Edit(index=0, span=(0, 1), replacement=None)


def test_parse_policy_typed_parameters() -> None:
    p = parse_policy("stale_tool_outputs:keep_last=3,stub=[gone {n}]")
    assert isinstance(p, StaleToolOutputs) and p.keep_last == 3 and p.stub == "[gone {n}]"
    assert parse_policy("token_budget:max_tokens=4096").max_tokens == 4096
    assert parse_policy(r'redact:patterns=["a,b","c{1,2}"]').patterns == ["a,b", "c{1,2}"]
    assert parse_policy(r"redact:patterns=\d{1,3},patterns=x,replacement=*").patterns == [
        r"\d{1,3}",
        "x",
    ]
    assert parse_policy("redact:patterns=one").patterns == ["one"]
    assert parse_policy(" observation_window : n = 4 ".replace(" : ", ":")).n == 4
    policy = StaleToolOutputs()
    assert parse_policy(policy) is policy


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nope", "unknown policy 'nope'"),
        ("stale_tool_outputs:keep=1", "no parameter 'keep'"),
        ("stale_tool_outputs:keep_last=two", "invalid parameters"),
        ("stale_tool_outputs:keep_last=-1", "invalid parameters"),
        ("stale_tool_outputs:keep_last", "expected key=value"),
        ("stale_tool_outputs:keep_last=1,keep_last=2", "given twice"),
        ("redact:patterns=[unclosed", "not JSON"),
        ("token_budget", "invalid parameters"),
    ],
)
def test_parse_policy_errors(spec: str, message: str) -> None:
    with pytest.raises(PolicyError, match=re.escape(message)):
        parse_policy(spec)


def test_register_function_factory(registry: dict) -> None:
    @register_policy("every_nth")
    def every_nth(n: int = 2, text: str = "-"):  # noqa: ANN202
        def policy(c: Conversation) -> list[Edit]:
            return [Edit(index=i, replacement=text) for i in c.observations[::n]]

        return policy

    p = parse_policy("every_nth:n=3,text=~")
    assert [e.index for e in p(conv(agent_run([1, 1, 1, 1])))] == [3, 9]
    assert "every_nth" in available_policies()
    with pytest.raises(PolicyError, match="already registered"):
        register_policy("every_nth")(StaleToolOutputs)
    with pytest.raises(PolicyError, match="invalid parameters"):
        parse_policy("every_nth:n=x")


def test_entry_point_policies(registry: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    ep = EntryPoint(
        name="third_party",
        value="leyline_agent.policies.observation_window:ObservationWindow",
        group=policy_registry.ENTRY_POINT_GROUP,
    )
    monkeypatch.setattr(
        policy_registry, "entry_points", lambda group: [ep] if group == ep.group else []
    )
    assert "third_party" in available_policies()
    p = parse_policy("third_party:n=1")
    assert isinstance(p, ObservationWindow) and p.n == 1
    assert registry["third_party"] is ObservationWindow


def test_docs_example_runs_as_written(registry: dict) -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "policies.md").read_text()
    code = re.search(r"## Writing a policy.*?```python\n(.*?)```", doc, re.S).group(1)
    assert len(code.strip().splitlines()) <= 16
    namespace: dict = {}
    exec(compile(code, "docs/policies.md", "exec"), namespace)  # noqa: S102
    assert issubclass(namespace["TruncateLongOutputs"], BaseModel)
    policy = parse_policy("truncate_long_outputs:max_chars=5")
    msgs = agent_run([1, 1])
    out = apply_edits(msgs, policy(conv(msgs))).messages
    assert out[3]["content"] == "out 0\n[...truncated]"
    assert out[5]["content"] == "out 1\n[...truncated]"
    assert out[:3] == msgs[:3]
