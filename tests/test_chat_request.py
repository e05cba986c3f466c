"""Requests the proxy refuses before any splice: what the messages say (OpenAI's roles only), a
``tool`` message without ``tool_call_id``, and one error object for every refusal."""

from __future__ import annotations

import json

import openai
import pytest
from test_proxy import POLICY, new_id, openai_client, serve_proxy

from leyline_agent.chat.request import request_error
from leyline_agent.proxy.responses import backend_error, error_response

CALL = {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
ASKED = [
    {"role": "user", "content": "List the files."},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
]


def test_the_role_error_names_openais_roles_only() -> None:
    error = request_error({"messages": [{"role": "robot", "content": "hi"}]})
    assert error == (
        "messages[0]: 'role' must be one of 'system', 'developer', 'user', 'assistant', 'tool'"
    )
    for internal in ("latest_reminder", "root"):  # accepted (SGLang does), not advertised
        assert request_error({"messages": [{"role": internal, "content": "x"}]}) is None


@pytest.mark.parametrize("call_id", [None, "", 7], ids=["missing", "empty", "not a string"])
def test_a_tool_message_needs_its_tool_call_id(call_id: object) -> None:
    tool: dict[str, object] = {"role": "tool", "content": "a.py b.py"}
    if call_id is not None:
        tool["tool_call_id"] = call_id
    assert request_error({"messages": [*ASKED, tool]}) == (
        "messages[2]: a tool message needs 'tool_call_id', the id of the assistant's tool call "
        "it answers"
    )
    assert request_error({"messages": [*ASKED, {**tool, "tool_call_id": "call_1"}]}) is None


def test_every_error_has_the_same_error_object() -> None:
    mine = json.loads(error_response(400, "no", "invalid_request_error").body)
    theirs = json.loads(backend_error(400, "no").body)
    assert mine["error"] == theirs["error"] == {
        "message": "no", "type": "invalid_request_error", "param": None, "code": 400,
    }  # fmt: skip
    assert theirs["object"] == "error" and theirs["message"] == "no"  # SGLang's fields too


@pytest.mark.sglang
def test_the_proxy_refuses_a_tool_message_without_its_id(leyline_server: str) -> None:
    with serve_proxy(leyline_server, POLICY) as proxy:
        client = openai_client(proxy, **{"X-Leyline-Session": new_id("no-call-id")})
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="default", max_tokens=1,
                messages=[*ASKED, {"role": "tool", "content": "a.py b.py"}],  # type: ignore[list-item]
            )  # fmt: skip
    assert e.value.status_code == 400
    assert "messages[2]: a tool message needs 'tool_call_id'" in e.value.message
