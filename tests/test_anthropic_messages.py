"""Anthropic's Messages API through the proxy (``POST /v1/messages``, ``/v1/messages/count_tokens``):
the request and response views without a server, then the real ``anthropic`` SDK against a real
proxy and ``leyline serve`` (a tool loop with the policy's splices, streaming, tool use, counting,
errors, Claude Code's session header)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import anthropic
import httpx
import pytest
from test_proxy import POLICY, SYSTEM, TOOLS, agent_conversation, expected_plans, serve_proxy

from leyline_agent.chat.anthropic import MessagesError, anthropic_usage, chat_body, content_blocks

ANTHROPIC_TOOLS = [
    {"name": t["function"]["name"], "description": t["function"]["description"],
     "input_schema": t["function"]["parameters"]}
    for t in TOOLS
]  # fmt: skip
GREEDY = {"temperature": 0}  # NOTE: anthropic 2.15's create() has no temperature argument


def as_anthropic(messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """A chat message list as ``(system, messages)`` of the Messages API."""
    system, out = "", []
    for m in messages:
        if m["role"] == "system":
            system = m["content"]
        elif m["role"] == "tool":
            block = {
                "type": "tool_result",
                "tool_use_id": m["tool_call_id"],
                "content": m["content"],
            }
            if out and out[-1]["role"] == "user" and out[-1]["content"][0]["type"] == "tool_result":
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block]})
        elif m["role"] == "assistant":
            blocks = [{"type": "text", "text": m["content"]}] if m["content"] else []
            blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                        "input": json.loads(c["function"]["arguments"])}
                       for c in m.get("tool_calls") or []]  # fmt: skip
            out.append({"role": "assistant", "content": blocks})
        else:
            out.append({"role": "user", "content": [{"type": "text", "text": m["content"]}]})
    return system, out


# --- views, no server ---------------------------------------------------------------------------


def test_blocks_are_the_chat_conversation_they_came_from() -> None:
    for messages in agent_conversation():
        system, msgs = as_anthropic(messages)
        chat = chat_body({"model": "m", "max_tokens": 8, "system": system, "messages": msgs})
        assert chat["messages"] == messages


def test_request_view_maps_every_field() -> None:
    body = {
        "model": "m", "max_tokens": 9, "stream": True, "stop_sequences": ["END"], "top_k": 5,
        "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief.",
                                                    "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "metadata": {"user_id": "u-7"},
        "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "Fix it."},
            {"role": "system", "content": [{"type": "text", "text": "Mind the tests."}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "look first", "signature": "s"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "tool_use", "id": "t1", "name": "read_file", "input": {"path": "ü.py"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1",
                 "content": [{"type": "text", "text": "x = 1"}], "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "and now?"}]},
        ],
    }  # fmt: skip
    assert chat_body(body) == {
        "model": "m", "max_tokens": 9, "stream": True, "stop": ["END"], "top_k": 5,
        "user": "u-7", "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
        "stream_options": {"include_usage": True},
        "messages": [
            {"role": "system", "content": "Be brief.", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
            {"role": "user", "content": "Fix it."},
            {"role": "system", "content": "Mind the tests."},
            {"role": "assistant", "content": "", "reasoning_content": "look first",
             "tool_calls": [{"id": "t1", "type": "function",
                             "function": {"name": "read_file", "arguments": '{"path": "ü.py"}'}}]},
            {"role": "tool", "tool_call_id": "t1", "content": "x = 1",
             "cache_control": {"type": "ephemeral"}},
            {"role": "user", "content": "and now?"},
        ],
    }  # fmt: skip


@pytest.mark.parametrize(
    "body, match",
    [({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
     ({"max_tokens": 1, "messages": []}, "at least one message"),
     ({"max_tokens": 1, "messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
     ({"max_tokens": 1, "messages": [{"role": "user", "content": [
         {"type": "image", "source": {}}]}]}, "messages.0.content.0: image"),
     ({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
       "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
     ({"max_tokens": 1, "messages": [{"role": "user", "content": [
         {"type": "tool_use", "id": "t", "name": "n", "input": {}}]}]}, "not valid in a user turn")],
)  # fmt: skip
def test_what_is_not_served_is_a_400_that_names_it(body: dict[str, Any], match: str) -> None:
    with pytest.raises(MessagesError, match=match):
        chat_body(body)


def test_blocks_merged_into_one_message_keep_the_longest_ttl() -> None:
    hour, five = {"type": "ephemeral", "ttl": "1h"}, {"type": "ephemeral", "ttl": "5m"}
    for marks in ((hour, five), (five, hour)):
        blocks = [
            {"type": "text", "text": t, "cache_control": m}
            for t, m in zip("ab", marks, strict=True)
        ]
        chat = chat_body(
            {"max_tokens": 1, "system": blocks, "messages": [{"role": "user", "content": blocks}]}
        )
        assert [m["cache_control"] for m in chat["messages"]] == [hour, hour]


def test_max_tokens_is_a_cap_that_fits_the_context() -> None:
    """The Messages route's budget (Claude Code asks 128,000) is lowered to what the context
    leaves after the prompt (``fit_budget``); on the chat route the same request is refused."""
    from leyline_agent.chat_turn import RequestRefused, prepare
    from leyline_agent.client import LeylineClient
    from leyline_agent.session import SessionCore
    from leyline_agent.wrapper import ConversationWrapper

    core = SessionCore(LeylineClient("http://127.0.0.1:9"), ConversationWrapper())
    body = chat_body(
        {"model": "m", "max_tokens": 10**6, "messages": [{"role": "user", "content": "x"}]}
    )
    turn = prepare(core, body, context_len=1000, fit_budget=True)  # nothing sent: no directive
    assert turn.body["max_tokens"] == 1000 - len(turn.pending.plan.tokens) > 900
    with pytest.raises(RequestRefused, match="maximum context length of 1000"):
        prepare(SessionCore(LeylineClient("http://127.0.0.1:9"), ConversationWrapper()), body,
                context_len=1000)  # fmt: skip


def test_usage_and_blocks() -> None:
    usage = {
        "prompt_tokens": 100,
        "completion_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 30},
    }
    assert anthropic_usage(usage, marked_end=80) == {
        "input_tokens": 20, "cache_creation_input_tokens": 50, "cache_read_input_tokens": 30,
        "output_tokens": 7,
    }  # fmt: skip
    assert anthropic_usage(usage)["input_tokens"] == 70
    assert anthropic_usage(usage, marked_end=10)["cache_creation_input_tokens"] == 0
    call = {"id": "c", "function": {"name": "read_file", "arguments": '{"path": "a"}'}}
    assert content_blocks({"content": "ok", "tool_calls": [call]}) == [
        {"type": "text", "text": "ok"},
        {"type": "tool_use", "id": "c", "name": "read_file", "input": {"path": "a"}},
    ]


# --- live ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def proxy(leyline_server: str) -> Any:
    with serve_proxy(leyline_server, POLICY) as url:
        yield url


def client(proxy: str, **headers: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy, api_key="unused", max_retries=0, timeout=120,
                               default_headers=headers or None)  # fmt: skip


@pytest.mark.sglang
def test_a_tool_loop_is_spliced_and_reports_anthropic_usage(proxy: str) -> None:
    name = f"anthropic-{uuid.uuid4().hex[:8]}"
    c = client(proxy, **{"X-Leyline-Session": name})
    turns = agent_conversation()
    plans = expected_plans(POLICY, turns)
    for t, (messages, plan) in enumerate(zip(turns, plans, strict=True)):
        system, msgs = as_anthropic(messages)
        m = c.messages.create(model="default", max_tokens=1, system=system, messages=msgs,
                              tools=ANTHROPIC_TOOLS, extra_body=GREEDY)  # fmt: skip
        assert m.type == "message" and m.role == "assistant" and m.stop_reason == "max_tokens"
        u = m.usage
        total = u.input_tokens + u.cache_read_input_tokens + (u.cache_creation_input_tokens or 0)
        assert total == len(plan.tokens) and u.output_tokens == 1
        if t >= 1:
            assert u.cache_read_input_tokens == len(plan.tokens) - len(plan.tail), t
    detail = httpx.get(f"{proxy}/leyline/sessions/{name}", timeout=30).json()
    assert [r["edited"] for r in detail["records"]] == [bool(p.directives) for p in plans]
    edited = [r for r in detail["records"] if r["edited"]]
    assert edited and all(r["spliced"] and r["splice_error"] is None for r in edited)
    count = c.messages.count_tokens(model="default", system=SYSTEM, tools=ANTHROPIC_TOOLS,
                                    messages=as_anthropic(turns[0])[1])  # fmt: skip
    assert count.input_tokens == len(plans[0].tokens)


@pytest.mark.sglang
def test_a_cache_control_breakpoint_is_reported_as_a_cache_write_then_read(proxy: str) -> None:
    c = client(proxy, **{"X-Leyline-Session": f"anthropic-{uuid.uuid4().hex[:8]}"})
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    first = c.messages.create(model="default", max_tokens=2, system=system,
                              messages=[{"role": "user", "content": "Find the bug."}],
                              extra_body=GREEDY)  # fmt: skip
    u = first.usage
    assert u.cache_read_input_tokens == 0 and (u.cache_creation_input_tokens or 0) > 10
    assert u.input_tokens > 0  # the user turn after the breakpoint
    again = c.messages.create(model="default", max_tokens=2, system=system, extra_body=GREEDY,
                              messages=[{"role": "user", "content": "Find the bug."},
                                        {"role": "assistant", "content": first.content or "."},
                                        {"role": "user", "content": "Go on."}])  # fmt: skip
    assert again.usage.cache_read_input_tokens >= (u.cache_creation_input_tokens or 0)
    assert again.usage.cache_creation_input_tokens == 0


@pytest.mark.sglang
def test_streaming_and_tool_use_in_anthropic_events(proxy: str) -> None:
    c = client(proxy, **{"X-Leyline-Session": f"anthropic-{uuid.uuid4().hex[:8]}"})
    ask = [{"role": "user", "content": "Say hi."}]
    plain = c.messages.create(model="default", max_tokens=4, messages=ask, extra_body=GREEDY)
    with c.messages.stream(model="default", max_tokens=4, messages=ask, extra_body=GREEDY) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop",
            "message_delta"} <= set(kinds)  # fmt: skip
    assert final.content[0].type == "text" and plain.content[0].type == "text"
    assert final.content[0].text == plain.content[0].text  # greedy: the same reply
    assert final.stop_reason == plain.stop_reason == "max_tokens"
    assert final.usage.output_tokens == plain.usage.output_tokens == 4
    # the same prompt again in the session: all of it read from cache but its last token
    total = plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    assert final.usage.cache_read_input_tokens == total - 1
    choice = {"type": "tool", "name": "read_file"}
    with c.messages.stream(
        model="default",
        max_tokens=24,
        messages=[{"role": "user", "content": "Read."}],
        tools=ANTHROPIC_TOOLS,
        tool_choice=choice,
        extra_body=GREEDY,
    ) as s:
        events = list(s)
        message = s.get_final_message()
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")  # fmt: skip
    [use] = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "read_file" and message.stop_reason == "tool_use" and partial


@pytest.mark.sglang
def test_errors_in_anthropic_format_and_claude_codes_session_header(proxy: str) -> None:
    c = client(proxy)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="default", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64",
                                          "media_type": "image/png", "data": "AA=="}}]}])  # fmt: skip
    assert e.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                            "message": "messages.0.content.0: image blocks are not served by this backend (text only)"}}  # fmt: skip
    with pytest.raises(anthropic.BadRequestError, match="longer than the model's context length"):
        c.messages.create(model="default", max_tokens=1,
                          messages=[{"role": "user", "content": "word " * 140_000}])  # fmt: skip
    marked = {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}
    with pytest.raises(anthropic.BadRequestError, match="A maximum of 4 blocks with cache_control"):
        c.messages.create(model="default", max_tokens=1, system=[marked, marked],  # type: ignore[list-item]
                          messages=[{"role": "user", "content": [marked, marked, marked]}])  # type: ignore[list-item]  # fmt: skip
    sid = uuid.uuid4().hex
    cc = client(proxy, **{"X-Claude-Code-Session-Id": sid})
    ids = set()
    for text in ("a", "b"):  # unrelated prompts: one session by the header, not by history
        r = cc.messages.with_raw_response.create(model="default", max_tokens=1, extra_body=GREEDY,
                                                 messages=[{"role": "user", "content": text}])  # fmt: skip
        ids.add(r.headers["x-leyline-session"])
    assert len(ids) == 1
    r = httpx.post(f"{proxy}/v1/messages?beta=true", timeout=60,
                   headers={"anthropic-version": "2023-06-01", "anthropic-beta": "context-management-2025-06-27"},
                   json={"model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})  # fmt: skip
    assert r.status_code == 200 and r.json()["type"] == "message"


@pytest.mark.sglang
def test_cache_control_on_tools_and_system_blocks_pins_each_breakpoint(proxy: str) -> None:
    name = f"anthropic-{uuid.uuid4().hex[:8]}"
    c = client(proxy, **{"X-Leyline-Session": name})
    tools = [
        *ANTHROPIC_TOOLS[:-1],
        {**ANTHROPIC_TOOLS[-1], "cache_control": {"type": "ephemeral", "ttl": "1h"}},
    ]
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "5m"}}]
    c.messages.create(model="default", max_tokens=1, system=system, tools=tools, extra_body=GREEDY,
                      messages=[{"role": "user", "content": "Find the bug."}])  # fmt: skip
    pins = httpx.get(f"{proxy}/leyline/sessions/{name}", timeout=30).json()["pins"]
    assert sorted(p["ttl_s"] for p in pins) in ([300.0, 3600.0], [3600.0])  # tools in the system
    assert max(p["ttl_s"] for p in pins) == 3600.0 and all(p["pinned_tokens"] > 0 for p in pins)
