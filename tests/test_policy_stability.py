"""Every built-in policy over growing conversations: edits keep each message's shape, and an edit
once made stays the same on every later turn (the server reuses its KV).

Conversations are generated (hypothesis): tool-calling and text-based agents, parallel calls,
steps without calls (answered by a plain user nudge), multi-part content, ``name`` on tool
messages. Turn ``t`` sends every message up to the outputs of step ``t``, as agents do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leyline_agent import Mode
from leyline_agent.policies import (
    ClearThinking,
    ClearToolUses,
    Conversation,
    Edit,
    NonePolicy,
    ObservationWindow,
    Redact,
    StaleToolOutputs,
    TokenBudget,
    apply_edits,
    available_policies,
    carry_edits,
    is_observation,
)

BUILT_INS = [
    "clear_thinking",
    "clear_tool_uses",
    "none",
    "observation_window",
    "redact",
    "stale_tool_outputs",
    "token_budget",
]
SHAPE_KEYS = ("role", "tool_call_id", "name", "tool_calls", "leyline_observation")

Step = tuple[int, list[int], bool]  # (outputs, their sizes in lines, multi-part content)


def build(steps: list[Step], text_agent: bool) -> tuple[list[dict[str, Any]], list[int]]:
    """The whole conversation, and per turn the number of messages it sends."""
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You fix bugs. Secret: sk-sys01"},
        {"role": "user", "content": [{"type": "text", "text": "Fix the tests."}]},
    ]
    ends = [len(msgs)]
    for s, (k, sizes, multipart) in enumerate(steps):
        calls = [
            {"id": f"c{s}.{j}", "type": "function", "function": {"name": "view", "arguments": "{}"}}
            for j in range(k)
        ]
        act: dict[str, Any] = {"role": "assistant", "content": f"step {s} sk-a{s}"}
        if s % 3 == 1:  # reasoning sent back (litellm), inline, or not at all
            act["reasoning_content"] = f"think {s}"
        elif s % 3 == 2:
            act["content"] = f"<think>think {s}</think>\n\n" + act["content"]
        if calls and not text_agent:
            act["tool_calls"] = calls
        msgs.append(act)
        for j in range(k):
            text = f"out {s}.{j} token sk-{s}{j}\n" + "line\n" * sizes[j % len(sizes)]
            content: Any = (
                [{"type": "text", "text": text[:7]}, {"type": "text", "text": text[7:]}]
                if multipart
                else text
            )
            if text_agent:
                msgs.append({"role": "user", "content": content, "leyline_observation": True})
            else:
                msgs.append(
                    {
                        "role": "tool",
                        "tool_call_id": f"c{s}.{j}",
                        "name": "view",
                        "content": content,
                    }
                )
        if k == 0:
            msgs.append({"role": "user", "content": "Please call a tool."})
        ends.append(len(msgs))
    return msgs, ends


def conversation(
    messages: list[dict[str, Any]], turn: int, previous: Sequence[Edit] = ()
) -> Conversation:
    counts = [len(str(m.get("content"))) // 4 + 3 for m in messages]
    return Conversation(
        messages, counts, turn=turn, count_tokens=lambda t: len(t) // 4 + 1, previous=previous
    )


def policies() -> list[Any]:
    return [
        NonePolicy(),
        StaleToolOutputs(keep_last=0),
        StaleToolOutputs(keep_last=2),
        ObservationWindow(n=0),
        ObservationWindow(n=3),
        TokenBudget(max_tokens=0),
        TokenBudget(max_tokens=60),
        TokenBudget(max_tokens=200),
        Redact(patterns=[r"sk-\w+", r"token sk"]),
        Redact(patterns=["line\nli"], roles=["tool", "user"]),  # spans across parts
        ClearThinking(keep_last=0),
        ClearThinking(keep_last=2),
        ClearToolUses(trigger_tokens=0, keep=1),
        ClearToolUses(trigger_tokens=150, keep=0, clear_at_least=40),
    ]


def test_every_built_in_is_covered() -> None:
    covered = {p.model_config.get("title") or type(p).__name__ for p in policies()}
    assert set(BUILT_INS) <= set(available_policies())
    assert len(covered) == len(BUILT_INS)


def check_shape(before: dict[str, Any], after: dict[str, Any]) -> None:
    """Only ``content`` may change, and it keeps its type (str stays str, list stays list)."""
    assert set(after) == set(before)
    assert all(after.get(k) == before.get(k) for k in SHAPE_KEYS)
    if isinstance(before["content"], list):
        assert isinstance(after["content"], list) and after["content"]
        assert all(p["type"] == "text" and isinstance(p["text"], str) for p in after["content"])
    else:
        assert isinstance(after["content"], str)


steps_strategy = st.lists(
    st.tuples(
        st.integers(0, 3),
        st.lists(st.integers(0, 30), min_size=1, max_size=3),
        st.booleans(),
    ),
    min_size=1,
    max_size=9,
)


@settings(max_examples=60, deadline=None)
@given(steps_strategy, st.booleans(), st.lists(st.integers(0, 400), min_size=10, max_size=10))
def test_edits_keep_shape_and_stay_once_made(
    steps: list[Step], text_agent: bool, reports: list[int]
) -> None:
    """``reports``: per turn, the characters of test report the system prompt carries (froggy
    rewrites it every turn: it grows and shrinks). Edits of the other messages stay once made;
    the previous turn's edits reach the policy as the wrapper passes them (``carry_edits``)."""
    messages, ends = build(steps, text_agent)
    for policy in policies():
        previous: list[dict[str, Any]] | None = None
        last: tuple[list[dict[str, Any]], list[Edit]] | None = None
        for turn, end in enumerate(ends):
            system = {**messages[0], "content": messages[0]["content"] + "r" * reports[turn]}
            sent = [system, *messages[1:end]]
            carried = carry_edits(*last, sent) if last else []
            edits = list(policy(conversation(sent, turn, carried)))
            result = apply_edits(sent, edits)
            assert result.sources == list(range(len(sent)))  # no built-in drops a message
            for before, after in zip(sent, result.messages, strict=True):
                check_shape(before, after)
            assert all(  # AMORTIZE edits touch observations, or an assistant's thinking only
                is_observation(sent[e.index])
                or (e.reason == "clear_thinking" and sent[e.index]["role"] == "assistant")
                for e in edits
                if e.mode is Mode.AMORTIZE
            )
            if previous is not None:
                for i, (orig, old) in enumerate(zip(messages, previous, strict=False)):
                    if i and old != orig:  # edited on the previous turn: the same on this one
                        assert result.messages[i] == old, (policy, turn, i)
            previous, last = result.messages, (sent, edits)


def test_multipart_content_stays_a_list() -> None:
    parts = [{"type": "text", "text": "abc"}, {"type": "image_url"}, {"type": "text", "text": "de"}]
    msg = {"role": "tool", "tool_call_id": "x", "name": "view", "content": parts}
    whole = apply_edits([msg], [Edit(index=0, replacement="[stub]")]).messages[0]
    assert whole == {**msg, "content": [{"type": "text", "text": "[stub]"}]}
    # "abc de": spans inside one part edit that part in place
    inside = apply_edits(
        [msg],
        [Edit(index=0, span=(1, 2), replacement="B"), Edit(index=0, span=(4, 6), replacement="")],
    ).messages[0]
    assert inside["content"] == [
        {"type": "text", "text": "aBc"},
        {"type": "image_url"},
        {"type": "text", "text": ""},
    ]
    across = apply_edits([msg], [Edit(index=0, span=(2, 5), replacement="-")]).messages[0]
    assert across["content"] == [{"type": "text", "text": "ab-e"}, {"type": "image_url"}]
    assert msg["content"] is parts and parts[0]["text"] == "abc"  # input untouched


def test_token_budget_keeps_evicting_when_the_agent_shrinks_its_history() -> None:
    """token_budget evicts while the prompt exceeds the budget; when the agent itself then shrinks
    an earlier message (froggy rewrites its system prompt) so that the prompt would fit again, the
    outputs it evicted stay evicted (``Conversation.previous``): none comes back verbatim."""
    messages, _ = build([(1, [20], False)] * 4, text_agent=False)
    big = [{**messages[0], "content": "s" * 800}, *messages[1:]]
    policy = TokenBudget(max_tokens=conversation(big, 3).total_tokens - 1)
    edits = policy(conversation(big, 3))
    assert [e.index for e in edits] == [3]  # the oldest output
    shrunk = [{**messages[0], "content": "x"}, *messages[1:]]
    assert policy(conversation(shrunk, 4)) == []  # stateless: within the budget again
    again = policy(conversation(shrunk, 4, carry_edits(big, edits, shrunk)))
    assert again == edits  # as the wrapper calls it: output 3 stays evicted
    dropped = shrunk[:3] + shrunk[4:]  # the agent dropped the evicted output itself
    assert carry_edits(big, edits, dropped) == []


def test_carry_edits_follows_messages() -> None:
    messages, _ = build([(1, [3], False)] * 4, text_agent=False)
    edits = [Edit(index=5, replacement="[x]"), Edit(index=7, replacement="[y]")]
    assert carry_edits(messages, edits, messages + [{"role": "user", "content": "go"}]) == edits
    window = messages[:2] + messages[4:]  # step 0 dropped: the edits move with their messages
    moved = carry_edits(messages, edits, window)
    assert [e.index for e in moved] == [3, 5] and [e.replacement for e in moved] == ["[x]", "[y]"]
    changed = [*messages[:5], {**messages[5], "content": "new"}, *messages[6:]]
    assert [e.index for e in carry_edits(messages, edits, changed)] == [7]


@pytest.mark.parametrize("policy", [StaleToolOutputs(keep_last=1), ObservationWindow(n=1)])
def test_window_policies_stay_stable_when_the_agent_drops_whole_old_steps(policy: Any) -> None:
    """stale_tool_outputs counts steps back from the last one, so dropping the oldest steps (a
    sliding history window) changes nothing it already decided; observation_window counts
    observations back from the last one, the same."""
    messages, ends = build([(1, [3], False)] * 5, text_agent=False)
    full = apply_edits(messages, policy(conversation(messages, 5))).messages
    window = messages[:2] + messages[4:]  # step 0 (assistant + output) dropped
    cut = apply_edits(window, policy(conversation(window, 6))).messages
    assert cut == full[:2] + full[4:]


def wrapper_policies() -> list[str]:
    """Every built-in, with parameters under which it edits these conversations."""
    return [
        "none",
        "stale_tool_outputs:keep_last=1",
        "observation_window:n=1",
        "token_budget:max_tokens=700",
        'redact:patterns=["sk-\\\\w+"]',
        "clear_thinking:keep_last=1",
        "clear_tool_uses:trigger_tokens=300,keep=1",
    ]


def test_wrapper_policies_cover_every_built_in() -> None:
    assert {spec.partition(":")[0] for spec in wrapper_policies()} == set(BUILT_INS)


@pytest.mark.parametrize("spec", wrapper_policies())
def test_evicted_outputs_stay_evicted_when_an_earlier_message_shrinks(spec: str) -> None:
    """The system prompt carries the latest test report (froggy): it grows, then shrinks. An
    output a policy evicted stays evicted on every later turn (it never comes back verbatim,
    which would cost a re-prefill from it on), through the wrapper as the proxy runs it."""
    from leyline_agent import ConversationWrapper

    wrapper = ConversationWrapper(None, spec)
    messages, ends = build([(1, [25], False)] * 6, text_agent=False)
    reports = [40, 200, 400, 400, 20, 5, 300]  # lines of test report in the system prompt
    evicted: dict[int, Any] = {}  # message index -> what it became
    for turn, end in enumerate(ends):
        report = "".join(f"test_{k} FAILED\n" for k in range(reports[turn]))
        sent = [{**messages[0], "content": messages[0]["content"] + "\n" + report}]
        sent += messages[1:end]
        plan = wrapper.plan(sent)
        for i, was in evicted.items():
            assert plan.messages[i] == was, (spec, turn, i)  # still evicted, the same stub
        for i, (orig, now) in enumerate(zip(sent, plan.messages, strict=True)):
            if i and is_observation(orig) and now != orig:
                evicted.setdefault(i, now)
        wrapper.commit(plan)
    if spec.startswith(("stale", "observation", "token")):
        assert evicted, spec  # the shape makes every evicting policy evict
