"""``clear_thinking``: the thinking of every assistant message but the last ``keep_last`` that carry
any is cleared, once and for good; through the wrapper, each newly cleared think block is one small
AMORTIZE directive."""

from __future__ import annotations

from typing import Any

import pytest
from reasoning import TOOLS, session, template, tokenizer

from leyline_agent import ConversationWrapper, Mode
from leyline_agent.chat.render import Renderer
from leyline_agent.directive import apply_directives
from leyline_agent.policies import (
    ClearThinking,
    Conversation,
    Edit,
    PolicyError,
    apply_edits,
    carry_edits,
    parse_policy,
)
from leyline_agent.policies.clear_thinking import inline_thinking


def conv(messages: list[dict[str, Any]], previous: list[Edit] | None = None) -> Conversation:
    return Conversation(messages, [10] * len(messages), previous=previous or [])


def thinking_messages() -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "a", "reasoning_content": "think 1"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "<think>\nthink 2\n</think>\n\nb"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "plain"},  # no thinking: not counted
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "think 3</think>c", "reasoning_content": ""},
    ]


def test_clears_all_but_the_last_with_thinking() -> None:
    msgs = thinking_messages()
    edits = ClearThinking(keep_last=1)(conv(msgs))
    assert {(e.index, e.key) for e in edits} == {(1, "reasoning_content"), (3, "content")}
    assert all(e.mode is Mode.AMORTIZE and e.reason == "clear_thinking" for e in edits)
    out = apply_edits(msgs, edits).messages
    assert out[1] == {**msgs[1], "reasoning_content": ""}  # the key stays: same shape
    assert out[3] == {**msgs[3], "content": "b"}
    assert out[5:] == msgs[5:]
    edits0 = ClearThinking(keep_last=0)(conv(msgs))
    assert apply_edits(msgs, edits0).messages[7]["content"] == "c"  # opening tag in the prompt
    assert ClearThinking(keep_last=3)(conv(msgs)) == []
    assert inline_thinking("x <think>a</think>  y") == (2, 20)
    assert inline_thinking("no thinking") is None


def test_once_cleared_stays_cleared() -> None:
    """The agent drops the newest turns: the message it had cleared would be among the last
    ``keep_last`` again, but stays cleared (the previous edits reach the policy)."""
    msgs = thinking_messages()[:4]  # thinking at 1 and 3
    policy = ClearThinking(keep_last=1)
    edits = policy(conv(msgs))
    assert [e.index for e in edits] == [1]
    shorter = msgs[:2]
    assert policy(conv(shorter)) == []  # stateless: message 1 is the last with thinking
    assert policy(conv(shorter, carry_edits(msgs, edits, shorter))) == edits


def test_spec_and_edit_checks() -> None:
    assert parse_policy("clear_thinking:keep_last=2") == ClearThinking(keep_last=2)
    assert parse_policy("clear_thinking:mode=forget").mode is Mode.FORGET
    with pytest.raises(ValueError, match="replacement"):
        Edit(index=0, key="reasoning_content", replacement=None)
    with pytest.raises(PolicyError, match="reasoning_content"):
        apply_edits(
            [{"role": "user", "content": "x"}],
            [Edit(index=0, key="reasoning_content", replacement="")],
        )
    m = {"role": "assistant", "content": "abc", "reasoning_content": "0123456789"}
    both = [
        Edit(index=0, key="reasoning_content", span=(2, 4), replacement="-"),
        Edit(index=0, span=(0, 1), replacement="A"),
    ]
    assert apply_edits([m], both).messages == [
        {**m, "content": "Abc", "reasoning_content": "01-456789"}
    ]


def keeps_thinking() -> Renderer:
    """Qwen3's template with Qwen3.6's ``preserve_thinking`` switch (the shape its published
    template has: ``preserve_thinking or loop.index0 > ns.last_query_index``), switched on: every
    earlier assistant turn keeps its thinking."""
    src = template("qwen3")
    old = "{%- if loop.index0 > ns.last_query_index %}"
    assert src.count(old) == 1
    src = src.replace(
        old,
        "{%- if (preserve_thinking is defined and preserve_thinking is true)"
        " or (loop.index0 > ns.last_query_index) %}",
    )
    return Renderer(tokenizer("qwen3"), src, {"preserve_thinking": True}, source="qwen3-preserve")


@pytest.mark.parametrize("reasoning", ["field", "inline"])
def test_through_the_wrapper_each_turn_clears_one_think_block(reasoning: str) -> None:
    r = keeps_thinking()
    w = ConversationWrapper(r, "clear_thinking:keep_last=2")
    cleared: dict[int, dict[str, Any]] = {}
    turns = session([[1, 1, 1, 1], [1, 1]], (reasoning,))  # type: ignore[arg-type]
    thought = r.count(
        "I should look at module 0.0 first; it is where the failing value comes from."
    )
    for t, messages in enumerate(turns):
        old = list(w.tokens)
        plan = w.plan(messages, TOOLS)
        assert apply_directives(old[: plan.base_len], plan.directives) + plan.tail == plan.tokens
        for i, was in cleared.items():
            assert plan.messages[i] == was, (t, i)  # cleared once, the same ever after
        for i, (m, sent) in enumerate(zip(messages, plan.messages, strict=True)):
            if m != sent:
                cleared.setdefault(i, sent)
        assistants = sum(m["role"] == "assistant" for m in plan.messages)  # each with thinking
        assert len(cleared) == max(0, assistants - 2)
        # at most one newly cleared message a turn: one directive about its think block's size
        assert len(plan.directives) <= 1
        for d in plan.directives:
            assert d.mode is Mode.AMORTIZE and d.removed <= thought + 8 and len(d.replacement) <= 2
        w.commit(plan)
    assert len(cleared) == 7 - 2  # 4 steps, an answer and 2 steps: all but the last 2
