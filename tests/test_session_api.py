"""The in-process API (``LeylineSession``) on the proxy tests' conversation, against a real
``leyline serve``; and ``chat_request_view`` against SGLang's own request models."""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_proxy import POLICY, TOOLS, agent_conversation, expected_plans

from leyline_agent.api import LeylineSession
from leyline_agent.chat.openai import chat_request_view
from leyline_agent.chat_turn import RequestRefused


@pytest.fixture(scope="module")
def turns() -> list[list[dict[str, Any]]]:
    return agent_conversation()


@pytest.mark.sglang
def test_chat_splices_and_caches_every_token_before_the_new_turn(
    leyline_server: str, turns: list[list[dict[str, Any]]]
) -> None:
    session = LeylineSession(leyline_server, POLICY)
    plans = expected_plans(POLICY, turns)
    for t, (messages, plan) in enumerate(zip(turns, plans, strict=True)):
        out = session.chat(messages, tools=TOOLS, max_tokens=1, temperature=0)
        assert out["choices"][0]["finish_reason"] is not None
        usage = out["usage"]
        prompt, cached = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
        assert prompt == len(plan.tokens)
        if t >= 1:
            assert cached == prompt - len(plan.tail), (t, prompt, cached, len(plan.tail))
        rec = session.records[-1]
        assert (rec.prompt_tokens, rec.server_cached_tokens) == (prompt, cached)
        assert rec.reused_tokens <= rec.best_reused_tokens <= rec.prompt_tokens
        assert rec.edited == bool(plan.directives) == rec.spliced
        assert rec.splice_error is None
    assert [r.edited for r in session.records] == [False] * 3 + [True] * 3


@pytest.mark.sglang
def test_chat_without_splice_reprefills_from_the_first_edit(
    leyline_server: str, turns: list[list[dict[str, Any]]]
) -> None:
    # NOTE: sharing off: in the tenant's shared namespace the bound is the whole prompt (any
    # other session may have cached a prefix of it); here it must be the session's own history
    session = LeylineSession(leyline_server, POLICY, splice=False, share_exact=False)
    plans = expected_plans(POLICY, turns[:4])
    for messages in turns[:4]:
        session.chat(messages, tools=TOOLS, max_tokens=1, temperature=0)
    rec, plan = session.records[-1], plans[-1]
    assert rec.edited and not rec.spliced
    first_edit = min(d.start for d in plan.directives)
    assert rec.server_cached_tokens <= first_edit < rec.prompt_tokens - len(plan.tail)
    assert rec.server_cached_tokens == rec.best_reused_tokens


@pytest.mark.sglang
def test_chat_refuses_what_the_backend_would_before_any_splice(
    leyline_server: str, turns: list[list[dict[str, Any]]]
) -> None:
    """The in-process API runs the proxy's checks (``chat_turn.prepare``): a request the backend
    would refuse raises ``RequestRefused`` and changes nothing (before: the policy's splice ran,
    then the backend answered 400 and the session recorded a failed, spliced turn)."""
    session = LeylineSession(leyline_server, POLICY, share_exact=False)
    for messages in turns[:3]:
        session.chat(messages, tools=TOOLS, max_tokens=1, temperature=0)
    held, records = list(session.core.wrapper.tokens), len(session.records)
    edited = turns[3]  # the policy edits this turn: it would splice
    assert expected_plans(POLICY, turns[:4])[-1].directives
    with pytest.raises(RequestRefused, match="maximum context length of 131072"):
        session.chat(edited, tools=TOOLS, max_tokens=200_000, temperature=0)
    bad = [*edited[:-1], {"role": "robot", "content": "hi"}]
    with pytest.raises(RequestRefused, match="'role' must be one of"):
        session.chat(bad, tools=TOOLS, max_tokens=1, temperature=0)
    assert session.core.wrapper.tokens == held and len(session.records) == records
    out = session.chat(edited, tools=TOOLS, max_tokens=1, temperature=0)  # the cache is as it was
    plan = expected_plans(POLICY, turns[:4])[-1]
    usage = out["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(plan.tokens) - len(plan.tail)
    assert session.records[-1].spliced and session.records[-1].splice_error is None


def test_request_view_is_what_sglang_templates() -> None:
    """Tools dumped through SGLang's ``Tool`` model and tool-call arguments parsed and re-dumped
    render exactly as the view; the view is a fixed point."""
    protocol = pytest.importorskip("sglang.srt.entrypoints.openai.protocol")
    tools = [
        *TOOLS,
        {"type": "function", "function": {"name": "x", "strict": True, "extra": 1}, "other": 2},
        {"function": {"parameters": {}, "name": "y", "strict": None}, "defer_loading": True},
    ]
    messages = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "x", "arguments": '{"a":1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "ok"},  # not last: stays an assistant
    ]
    view_messages, view_tools = chat_request_view(messages, tools)
    served = [protocol.Tool.model_validate(t).model_dump() for t in tools]
    assert json.dumps(view_tools) == json.dumps(served)
    assert chat_request_view(view_messages, view_tools) == (view_messages, view_tools)
    assert view_messages[1]["content"] == ""
    assert view_messages[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    assert messages[1]["content"] is None  # the input is not modified
    # SGLang templates no tools under tool_choice="none", only the named one under a named choice.
    assert chat_request_view(messages, tools, "none")[1] is None
    named = {"type": "function", "function": {"name": "run_tests"}}
    assert chat_request_view(messages, tools, named)[1] == [served[1]]
