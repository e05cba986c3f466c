"""Reasoning-model templates edit the middle of the history on every follow-up: Qwen3 renders
``<think>`` blocks only after the last user query, GLM-4.5 empties them before it, Kimi-K2-thinking
before the last plain answer. Every such edit must become small directives, with policy ``none``:
each turn keeps at least 90% of what an exact splice keeps, and applying the directives to the
old prompt gives exactly the new render.

Templates as published (``tests/templates``, sources in its README), on a tokenizer built here
(``reasoning.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reasoning import FAMILIES, TOOLS, Reasoning, exact_reuse, renderer, session

from leyline_agent import ConversationWrapper
from leyline_agent.chat.render import Renderer
from leyline_agent.chat.render_cache import IncrementalRenderer
from leyline_agent.directive import apply_directives
from leyline_agent.messages import message_text
from leyline_agent.wrapper import TurnPlan

RENDERERS = {f: renderer(f) for f in FAMILIES}


def drive(
    r: Renderer, turns: list[list[dict[str, Any]]], policy: str = "none"
) -> list[tuple[TurnPlan, int]]:
    """Every turn through a wrapper (incremental rendering, as the proxy plans): each plan, exact
    against the previous prompt, with what an exact splice of that prompt keeps."""
    w = ConversationWrapper(r, policy)
    out = []
    for messages in turns:
        old = list(w.tokens)
        plan = w.plan(messages, TOOLS)
        assert apply_directives(old[: plan.base_len], plan.directives) + plan.tail == plan.tokens
        assert plan.tokens == r.render(plan.messages, TOOLS).tokens
        out.append((plan, exact_reuse(old, plan.tokens)))
        w.commit(plan)
    return out


def check_reuse(plans: list[tuple[TurnPlan, int]]) -> None:
    for t, (plan, exact) in enumerate(plans):
        assert plan.reused >= 0.9 * exact, (t, plan.reused, exact, plan.directives)


@pytest.mark.parametrize("family", FAMILIES)
def test_given_case_three_small_deletions(family: str) -> None:
    """Issue 23's case: three tool steps whose assistant messages carry ``reasoning_content``,
    an answer, a follow-up. The follow-up drops (Qwen3) or empties (GLM, Kimi) the three think
    blocks: three directives of the think block's size, nothing else re-prefilled but the tail."""
    r = RENDERERS[family]
    turns = session([[1, 1, 1], []])
    plans = drive(r, turns)
    check_reuse(plans)
    for plan, _ in plans[:-1]:  # the tool loop appends only
        assert plan.directives == [] and not plan.fallback
    follow_up, exact = plans[-1]
    assert len(follow_up.directives) == 3
    thought = r.count(
        "I should look at module 0.0 first; it is where the failing value comes from."
    )
    for d in follow_up.directives:
        assert 1 <= d.removed <= thought + 8 and len(d.replacement) <= 2
    prefilled = len(follow_up.tail) + sum(len(d.replacement) for d in follow_up.directives)
    assert prefilled <= len(follow_up.tokens) - exact + 8
    assert follow_up.reused >= exact - 8


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "reasoning",
    [("field",), ("inline",), ("dropped",), ("field", "dropped", "inline")],
    ids=["reasoning_content", "inline", "dropped_by_client", "mixed"],
)
def test_several_follow_ups_with_parallel_calls(family: str, reasoning: tuple[Reasoning]) -> None:
    """Three episodes (parallel calls in some steps), each follow-up editing the previous
    episode's turns; reasoning sent back as a field, inline in ``content``, dropped by the client,
    or mixed."""
    r = RENDERERS[family]
    plans = drive(r, session([[2, 1, 3], [1, 2], [1]], reasoning))
    check_reuse(plans)
    for plan, _ in plans:
        big = [d for d in plan.directives if d.removed > 40 or len(d.replacement) > 40]
        assert not big, big


@pytest.mark.parametrize("family", FAMILIES)
def test_spans_hold_their_message(family: str) -> None:
    """With a follow-up after a tool loop the spans still frame each message: its content and
    tool calls lie in its own span, and the incremental renderer returns the same spans."""
    r = RENDERERS[family]
    messages = session([[2, 1], [1]], ("field", "inline"))[-1]
    full = r.render(messages, TOOLS)
    inc = IncrementalRenderer(r)
    for n in range(1, len(messages) + 1):
        got = inc.render(messages[:n], TOOLS)
        assert got == r.render(messages[:n], TOOLS)
    for (s, e), m in zip(full.spans, messages, strict=True):
        text = r.decode(full.tokens[s:e])
        content = message_text(m).split("</think>")[-1].strip()
        if content:
            assert content in text, (m, text)
        for c in m.get("tool_calls", []):
            assert c["id"] in text or c["function"]["arguments"].split('"')[3] in text, (c, text)


@settings(max_examples=40, deadline=None)
@given(
    family=st.sampled_from(FAMILIES),
    episodes=st.lists(st.lists(st.integers(0, 2), max_size=3), min_size=1, max_size=3),
    reasoning=st.lists(st.sampled_from(["field", "inline", "dropped"]), min_size=1, max_size=3),
)
def test_generated_sessions(
    family: str, episodes: list[list[int]], reasoning: list[Reasoning]
) -> None:
    # NOTE: a step without calls is a plain answer mid-episode (Kimi's split point moves).
    check_reuse(drive(RENDERERS[family], session(episodes, reasoning)))
