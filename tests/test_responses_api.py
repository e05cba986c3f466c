"""The OpenAI Responses API through the proxy (``POST /v1/responses``, ``GET``/``DELETE
/v1/responses/{id}``): the request and response views without a server, then the real ``openai``
client against a real proxy and ``leyline serve`` (stateless with the policy's splices, chained
with ``previous_response_id``, streamed, errors)."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_proxy import POLICY, TOOLS, agent_conversation, expected_plans, openai_client, serve_proxy

from leyline_agent.chat.responses import ResponsesError, chat_body, input_messages, output_items
from leyline_agent.proxy.response_store import ResponseStore

RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def as_items(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A chat message list as Responses input items (what a Responses client sends)."""
    items: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"],
                          "output": m["content"]})  # fmt: skip
            continue
        kind = "output_text" if m["role"] == "assistant" else "input_text"
        items.append({"type": "message", "role": m["role"],
                      "content": [{"type": kind, "text": m["content"]}]})  # fmt: skip
        for call in m.get("tool_calls") or []:
            items.append({"type": "function_call", "call_id": call["id"],
                          "name": call["function"]["name"],
                          "arguments": call["function"]["arguments"]})  # fmt: skip
    return items


# --- views, no server ---------------------------------------------------------------------------


def test_input_items_are_the_chat_conversation_they_came_from() -> None:
    for messages in agent_conversation():
        assert input_messages(as_items(messages)) == messages


def test_request_view_maps_every_field() -> None:
    body = {
        "model": "m", "instructions": "Be brief.", "input": [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "look first"}]},
            {"type": "function_call", "call_id": "c1", "name": "read_file", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "x = 1"},
            {"role": "user", "content": "and now?"},
        ],
        "tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "read_file"},
        "max_output_tokens": 7, "temperature": 0.5, "stream": True, "store": False,
        "ebnf": 'root ::= "x"', "text": {"format": {"type": "text"}}, "include": [],
    }  # fmt: skip
    history = [{"role": "user", "content": "start"}]
    chat, conversation = chat_body(body, history)
    assert conversation == [
        {"role": "user", "content": "start"},
        {"role": "assistant", "content": "", "reasoning_content": "look first",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "read_file", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x = 1"},
        {"role": "user", "content": "and now?"},
    ]  # fmt: skip
    assert chat == {
        "model": "m", "messages": [{"role": "system", "content": "Be brief."}, *conversation],
        "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "read_file"}},
        "max_tokens": 7, "temperature": 0.5, "stream": True, "ebnf": 'root ::= "x"',
        "stream_options": {"include_usage": True},
    }  # fmt: skip


@pytest.mark.parametrize(
    "body, param",
    [({"input": [{"type": "web_search_call"}]}, "input[0]"),
     ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
     ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
      "input[0].content[0]"),
     ({"input": []}, "input"), ({"input": 3}, "input"), ({"input": "x", "instructions": 1},
                                                         "instructions")],
)  # fmt: skip
def test_what_is_not_served_is_a_400_naming_the_param(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ResponsesError) as e:
        chat_body(body)
    assert e.value.param == param


def test_response_view_items() -> None:
    call = {"id": "c9", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}}
    items = output_items({"role": "assistant", "content": "ok", "tool_calls": [call]})
    assert [i["type"] for i in items] == ["message", "function_call"]
    assert items[0]["content"][0]["text"] == "ok"
    assert (items[1]["call_id"], items[1]["name"], items[1]["arguments"]) == (
        "c9",
        "run_tests",
        "{}",
    )
    assert [i["type"] for i in output_items({"content": None, "tool_calls": [call]})] == [
        "function_call"
    ]


def test_store_is_bounded_expires_and_is_per_tenant() -> None:
    now = [0.0]
    store = ResponseStore(max_entries=2, ttl_s=10.0, clock=lambda: now[0])
    for n in range(3):
        store.put("t", {"id": f"r{n}"}, [])
    assert store.get("t", "r0") is None and store.get("t", "r1") is not None  # r0 dropped
    assert store.get("other", "r1") is None  # another tenant's
    now[0] = 10.0
    assert store.get("t", "r2") is None and len(store) == 1  # expired, then removed
    assert store.delete("t", "r1") and not store.delete("t", "r1")


# --- live ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def proxy(leyline_server: str) -> Any:
    with serve_proxy(leyline_server, POLICY) as url:
        yield url


@pytest.mark.sglang
def test_stateless_responses_are_spliced_like_chat(proxy: str) -> None:
    """A tool loop sent as Responses items: the same plans as the chat route, the policy's edits
    spliced, the reused tokens in ``input_tokens_details.cached_tokens``."""
    name = f"responses-stateless-{uuid.uuid4().hex[:8]}"  # NOTE: a namespace no run cached
    client = openai_client(proxy, **{"X-Leyline-Session": name})
    turns = agent_conversation()
    plans = expected_plans(POLICY, turns)
    for t, (messages, plan) in enumerate(zip(turns, plans, strict=True)):
        r = client.responses.create(model="default", input=as_items(messages),
                                    tools=RESPONSES_TOOLS, max_output_tokens=1, temperature=0,
                                    store=False)  # fmt: skip
        assert r.object == "response" and r.status in ("completed", "incomplete")
        assert r.usage is not None and r.usage.input_tokens == len(plan.tokens)
        if t >= 1:
            cached = r.usage.input_tokens_details.cached_tokens
            assert cached == len(plan.tokens) - len(plan.tail), (t, cached)
    detail = httpx.get(f"{proxy}/leyline/sessions/{name}", timeout=30).json()
    assert [r["edited"] for r in detail["records"]] == [bool(p.directives) for p in plans]
    assert sum(detail["records"][t]["spliced"] for t in range(len(plans))) >= 3
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)  # store=False: not kept
    families = {
        f.name: f for f in text_string_to_metric_families(httpx.get(proxy + "/metrics").text)
    }
    by_route = {
        (f.name, s.labels["route"]): s.value
        for f in families.values() if f.name.startswith("leyline_proxy_route_") for s in f.samples
    }  # fmt: skip
    spliced = sum(r["spliced"] for r in detail["records"])
    assert by_route[("leyline_proxy_route_turns", "/v1/responses")] >= len(plans)
    assert by_route[("leyline_proxy_route_spliced_turns", "/v1/responses")] >= spliced


@pytest.mark.sglang
def test_a_chain_of_stored_responses_is_one_session(proxy: str) -> None:
    client = openai_client(proxy)
    first = client.responses.with_raw_response.create(
        model="default", instructions="Be brief.", input="The tests fail. Why?",
        max_output_tokens=4, temperature=0,
    )  # fmt: skip
    r1 = first.parse()
    assert r1.usage is not None and r1.usage.input_tokens_details.cached_tokens == 0
    second = client.responses.with_raw_response.create(
        model="default", instructions="Be brief.", previous_response_id=r1.id,
        input="Look again.", max_output_tokens=4, temperature=0,
    )  # fmt: skip
    r2 = second.parse()
    session = first.headers["x-leyline-session"]
    assert second.headers["x-leyline-session"] == session
    assert r2.previous_response_id == r1.id and r2.usage is not None
    # the whole first prompt and its reply are cached: only the new user turn is prefilled
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens
    stored = client.responses.retrieve(r1.id)
    assert (stored.id, stored.output_text) == (r1.id, r1.output_text)
    client.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(model="default", previous_response_id=r1.id, input="x")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")


@pytest.mark.sglang
def test_streamed_text_and_function_calls_in_the_responses_event_format(proxy: str) -> None:
    client = openai_client(proxy, **{"X-Leyline-Session": f"responses-{uuid.uuid4().hex[:8]}"})
    plain = client.responses.create(model="default", input="Say hi.", max_output_tokens=4,
                                    temperature=0, store=False)  # fmt: skip
    events = list(client.responses.create(model="default", input="Say hi.", max_output_tokens=4,
                                          temperature=0, stream=True, store=False))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == done.output_text == plain.output_text  # greedy: the same reply
    assert done.usage is not None and plain.usage is not None
    assert done.usage.input_tokens == plain.usage.input_tokens
    assert plain.usage.input_tokens_details.cached_tokens == 0
    # the same prompt again in the session: all of it cached but the last token (SGLang's rule)
    assert done.usage.input_tokens_details.cached_tokens == plain.usage.input_tokens - 1
    calls = list(client.responses.create(
        model="default", input="Read a file.", tools=RESPONSES_TOOLS,
        tool_choice={"type": "function", "name": "read_file"}, max_output_tokens=24,
        temperature=0, stream=True,
    ))  # fmt: skip
    deltas = "".join(e.delta for e in calls if e.type == "response.function_call_arguments.delta")
    [item] = [i for i in calls[-1].response.output if i.type == "function_call"]
    assert item.name == "read_file" and item.arguments == deltas and deltas
    stored = client.responses.retrieve(calls[-1].response.id)  # a streamed response is kept too
    assert [i.type for i in stored.output] == ["function_call"]


@pytest.mark.sglang
def test_errors_are_in_openai_format_and_refused_before_any_splice(proxy: str) -> None:
    client = openai_client(proxy)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="default", input=[{"type": "web_search_call", "id": "w"}])
    assert e.value.body["param"] == "input[0]"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.responses.create(model="default", input="x", max_output_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match="must not be empty"):
        client.responses.create(model="default", input=[])
