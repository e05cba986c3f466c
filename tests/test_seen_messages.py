"""``SessionCore.seen``: a chat turn checks, serves and reads the markers of only the messages
after the ones the session's last request held (the whole history is resent every turn), with
the same outcome as checking every message.

No backend: these turns only append (no splice is sent), and ``chat_turn.complete`` records the
backend's answer from a dict written here (``_turn``), as ``bench_proxy_cpu.py`` does. Also the
proxy's JSON (``proxy.fastjson``: orjson with json's outcome).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from leyline_agent import chat_turn
from leyline_agent.chat.request import may_hold_surrogates, request_error
from leyline_agent.chat_turn import RequestRefused
from leyline_agent.client import LeylineClient
from leyline_agent.proxy import fastjson
from leyline_agent.session import SessionCore
from leyline_agent.wrapper import ConversationWrapper

TOOLS = [{"type": "function", "function": {"name": "sh", "parameters": {"type": "object"}}}]
BAD = "bytes \udcff here"  # a lone surrogate: what surrogateescape'd bytes become


def _core() -> SessionCore:
    # NOTE: nothing listens on port 9; appended turns send no splice
    return SessionCore(LeylineClient("http://127.0.0.1:9", gateway=False), ConversationWrapper())


def _turns(n: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the test."}]
    for i in range(n):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "sh", "arguments": "{}"}}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"out {i}"})
    return messages


def _body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return json.loads(json.dumps({"model": "m", "messages": messages, "tools": TOOLS}))


def _turn(core: SessionCore, body: dict[str, Any]) -> chat_turn.ChatTurn:
    ct = chat_turn.prepare(core, body)
    ids = ct.pending.plan.tokens
    answer = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "a"}}],
        "usage": {"prompt_tokens": len(ids), "completion_tokens": 1},
    }
    chat_turn.complete(core, ct, answer, request_ms=1.0)
    return ct


def test_a_turn_checks_only_new_messages_and_plans_as_a_fresh_session() -> None:
    core = _core()
    for n in range(1, 5):
        ct = _turn(core, _body(_turns(n)))
        assert core.seen.known(_body(_turns(n))["messages"]) == 1 + 2 * n
        fresh = chat_turn.prepare(_core(), _body(_turns(n)))
        assert ct.pending.plan.tokens == fresh.pending.plan.tokens
        assert ct.body["messages"] == fresh.body["messages"]


@pytest.mark.parametrize("where", ["new", "repeated"])
def test_a_lone_surrogate_is_refused_in_a_new_or_a_changed_message(where: str) -> None:
    core = _core()
    _turn(core, _body(_turns(2)))
    seen = copy.deepcopy(core.seen.messages)
    messages = _turns(3)
    index = len(messages) - 1 if where == "new" else 2  # a repeated message, changed
    messages[index]["content"] = BAD
    with pytest.raises(RequestRefused, match=rf"at messages\[{index}\]\.content \(character 6"):
        chat_turn.prepare(core, _body(messages))
    assert core.seen.messages == seen  # a refused request leaves the session as it was
    assert len(core.records) == 1


def test_a_message_mutated_after_it_was_sent_is_checked_again() -> None:
    core = _core()
    body = _body(_turns(2))
    _turn(core, body)
    body["messages"][2]["content"] = BAD  # the client's own dict, changed in place
    assert core.seen.known(body["messages"]) == 2
    with pytest.raises(RequestRefused, match=r"at messages\[2\]\.content"):
        chat_turn.prepare(core, body)


def test_markers_of_repeated_messages_count_toward_anthropics_limit() -> None:
    core = _core()
    messages = _turns(3)
    for m in messages[1:5]:
        m["cache_control"] = {"type": "ephemeral"}
    ct = _turn(core, _body(messages[:5]))
    assert [m.message for m in ct.markers] == [1, 2, 3, 4]
    messages[6]["cache_control"] = {"type": "ephemeral"}
    with pytest.raises(RequestRefused, match="Found 5"):
        chat_turn.prepare(core, _body(messages))
    del messages[1]["cache_control"]
    ct = chat_turn.prepare(core, _body(messages))
    assert [m.message for m in ct.markers] == [2, 3, 4, 6]


@pytest.mark.parametrize(
    ("text", "ascii_", "suspect"),
    [
        ("plain é text", True, False),
        ("plain é text", False, False),
        ("an emoji 😀 (a surrogate pair when escaped)", True, True),
        ("an emoji 😀", False, False),
        (BAD, True, True),
        ("a backslash then uD83D: \\uD83D", True, True),  # suspect; text_error then tells
    ],
)
def test_a_body_without_a_surrogate_escape_cannot_hold_a_lone_surrogate(
    text: str, ascii_: bool, suspect: bool
) -> None:
    raw = json.dumps(_body([{"role": "user", "content": text}]), ensure_ascii=ascii_).encode()
    assert may_hold_surrogates(raw) is suspect
    assert (request_error(json.loads(raw)) is not None) is (text == BAD)


@pytest.mark.parametrize(
    "value",
    [
        {"messages": [{"role": "user", "content": "é 😀 \ue000"}], "n": 1, "t": 0.1},
        {"big": 2**70, "neg": -(2**70)},  # past orjson's 64 bits: json's output
    ],
)
def test_fastjson_writes_what_json_reads_back(value: dict[str, Any]) -> None:
    raw = fastjson.dumps(value)
    assert json.loads(raw) == value and fastjson.loads(raw) == value


def test_fastjson_reads_a_lone_surrogate_escape_as_json_does() -> None:
    raw = json.dumps({"content": BAD}).encode()  # orjson refuses it; json reads it
    assert fastjson.loads(raw) == json.loads(raw) == {"content": BAD}
    with pytest.raises(ValueError):
        fastjson.loads(b'{"content": ')
