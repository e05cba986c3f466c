"""Prompt caching as Anthropic defines it, without a server: every ``cache_control`` breakpoint
(messages, content parts, tools) with its own TTL (``markers.cache_markers``), more than 4 marked
blocks refused before any splice, and a session's pins, one per breakpoint (``SessionPins``
against a recording fake backend): two pins with their own TTLs, renewal, release of a breakpoint
no longer marked, expiry, the proxy's counters and the session record's ``pin``/``pins``. The
same against a real server through the real proxy: ``tests/test_sharing_live.py``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from test_proxy import SYSTEM, TOOLS, agent_conversation
from test_sharing import FakeBackend, _core, _turn

from leyline_agent.chat.openai import chat_request_view
from leyline_agent.chat_turn import RequestRefused, prepare, request_refusal
from leyline_agent.markers import (
    DEFAULT_TTL_S,
    MAX_BREAKPOINTS,
    Marker,
    breakpoint_error,
    cache_marker,
    cache_markers,
    marker_count,
    tools_end,
)
from leyline_agent.markers import (
    TOOLS as TOOLS_MARK,
)
from leyline_agent.proxy import SessionRegistry
from leyline_agent.proxy.retention import Retention
from leyline_agent.wrapper import ConversationWrapper


def _mark(ttl: Any = None) -> dict[str, Any]:
    return {"type": "ephemeral"} if ttl is None else {"type": "ephemeral", "ttl": ttl}


def _claude_code(turn: list[dict[str, Any]], short: str = "3s") -> list[dict[str, Any]]:
    """What Claude Code sends: ``"1h"`` on the system prompt, a short TTL on the last message."""
    out = [dict(m) for m in turn]
    out[0]["cache_control"] = _mark("1h")
    out[-1]["cache_control"] = _mark(short)
    return out


# --- markers ----------------------------------------------------------------------------------


def test_every_breakpoint_with_its_own_ttl_in_prompt_order() -> None:
    tools = [{**TOOLS[0], "cache_control": _mark("1h")}, TOOLS[1]]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": [{"type": "text", "text": "s", "cache_control": _mark("1h")}]},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "cache_control": _mark()},
        {"role": "user", "content": [{"type": "text", "text": "c", "cache_control": _mark("3s")},
                                     {"type": "text", "text": "d", "cache_control": _mark("5m")}]},
        {"role": "user", "content": "e", "cache_control": {"type": "persistent"}},  # not ours
    ]  # fmt: skip
    assert cache_markers(messages, tools) == [
        Marker(TOOLS_MARK, 3600.0, "1h"),
        Marker(0, 3600.0, "1h"),
        Marker(2, DEFAULT_TTL_S),
        Marker(3, 300.0, "5m"),  # marked twice: one breakpoint, the longest TTL
    ]
    assert marker_count(messages, tools) == 5 and breakpoint_error(messages, tools) is not None
    assert breakpoint_error(messages[1:], tools) is None  # 4 blocks: Anthropic's maximum
    assert cache_marker(messages) == Marker(3, 300.0, "5m")  # the last one, as before
    fn_marked = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "cache_control": _mark()}}]
    assert cache_markers([], fn_marked) == [Marker(TOOLS_MARK, DEFAULT_TTL_S)]
    view, view_tools = chat_request_view(messages, tools)
    assert "cache_control" not in repr(view) and "cache_control" not in repr(view_tools)


def test_more_than_four_marked_blocks_are_refused_before_any_splice() -> None:
    client = FakeBackend()
    core = _core(client, "a", policy="none")
    messages = [{"role": "system", "content": SYSTEM, "cache_control": _mark("1h")}]
    messages += [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}",
         "cache_control": _mark()}
        for i in range(MAX_BREAKPOINTS)
    ]  # fmt: skip
    body = {"model": "m", "messages": messages, "max_tokens": 1}
    message = "A maximum of 4 blocks with cache_control may be provided. Found 5."
    assert request_refusal(body) == message  # Anthropic's own words
    with pytest.raises(RequestRefused, match=message):
        prepare(core, body)
    assert client.calls == [] and core.wrapper.tokens == [] and core.records == []
    assert request_refusal({**body, "messages": messages[:4]}) is None
    tools = [{**TOOLS[0], "cache_control": _mark()}]
    assert "Found 5." in (request_refusal({**body, "messages": messages[:4], "tools": tools}) or "")
    assert request_refusal({"model": "m", "messages": "x"}) == "'messages' must be a non-empty list"


def test_a_tools_marker_pins_up_to_the_end_of_the_tools_rendering() -> None:
    """The embedded ChatML template renders the tools inside the system message (or, without
    one, in its default system block before message 0)."""
    wrapper = ConversationWrapper()
    decode = wrapper.renderer.decode
    with_system = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix it."}]
    for messages, piece in [(with_system, 1), (with_system[1:], 0)]:
        plan = wrapper.plan(*chat_request_view(messages, TOOLS))
        end = tools_end(plan.tokens, plan.spans, plan.tools, decode)
        assert end == (plan.spans[0][1] if piece else plan.spans[0][0]) > 0
        text = decode(plan.tokens[:end])
        assert text.endswith("</tool_call><|im_end|>\n") and '"name": "run_tests"' in text
        assert SYSTEM in text if piece else SYSTEM not in text
    plan = wrapper.plan(*chat_request_view(with_system, None))
    assert tools_end(plan.tokens, plan.spans, plan.tools, decode) == 0  # no tool rendered


# --- SessionPins: one pin per breakpoint ------------------------------------------------------


def test_two_breakpoints_two_pins_each_with_its_ttl_renewed_released_and_expired() -> None:
    client = FakeBackend()
    core = _core(client, "a", policy="none")
    decode = core.wrapper.renderer.decode
    turns = agent_conversation()
    pending = _turn(core, turns[1])
    plan = pending.plan
    markers = cache_markers(_claude_code(turns[1]))
    assert markers == [Marker(0, 3600.0, "1h"), Marker(len(turns[1]) - 1, 3.0, "3s")]
    first = core.pins.pin_marked(core.wrapper.tokens, plan, markers, decode)
    system, last = first.made
    assert (system.pinned_tokens, system.ttl_s) == (plan.spans[0][1], 3600.0)
    assert (last.pinned_tokens, last.ttl_s) == (plan.spans[-1][1], 3.0)
    assert (first.replaced, first.refused, first.stale) == (0, [], [])
    assert core.pins.live() == [system, last] and core.pins.pinned == last
    # the next turn marks the system prompt again (renewed) and moves the short marker on
    client.now += 1.0
    pending = _turn(core, turns[2])
    second = core.pins.pin_marked(
        core.wrapper.tokens, pending.plan, cache_markers(_claude_code(turns[2])), decode
    )
    renewed, moved = second.made
    assert renewed.pinned_tokens == system.pinned_tokens and renewed.pin_id != system.pin_id
    assert renewed.expires_at == client.now + 3600.0  # the TTL starts again
    assert moved.pinned_tokens == pending.plan.spans[-1][1] > last.pinned_tokens
    assert second.replaced == 2  # the renewed system pin and the short one no longer marked
    unpinned = [kw["pin_id"] for name, kw in client.calls if name == "unpin"]
    assert unpinned == [system.pin_id, last.pin_id]
    assert client.names()[-4:] == ["pin", "unpin", "pin", "unpin"]  # each new one first
    assert core.pins.live() == [renewed, moved]
    # the short one expires on time; the 1-hour one stays
    client.now += 3.0
    assert core.pins.live() == [renewed] and core.pins.pinned == renewed
    # a turn marking the system prompt alone: renewed; the expired pin is forgotten, not unpinned
    pending = _turn(core, turns[3])
    system_only = [Marker(0, 3600.0, "1h")]
    third = core.pins.pin_marked(core.wrapper.tokens, pending.plan, system_only, decode)
    [again] = third.made
    assert third.replaced == 1 and client.calls[-1] == ("unpin", {"pin_id": renewed.pin_id,
                                                                  "owner": None})  # fmt: skip
    assert core.pins.pins == {again.pinned_tokens: again}
    assert core.pins.release() == 1 and core.pins.live() == []


def test_a_breakpoint_no_longer_marked_stays_for_its_ttl_unless_of_no_use() -> None:
    """As Anthropic keeps a cache entry for its TTL whether or not later requests mark it: the
    1-hour system pin stays when only the last message is marked; the moved 5-minute pin goes
    (the new one covers it for longer); after an edit of the system prompt both go (their
    prefixes are not the session's any more)."""
    client = FakeBackend()
    core = _core(client, "a", policy="none")
    decode = core.wrapper.renderer.decode
    turns = agent_conversation()
    pending = _turn(core, turns[1])
    marked = cache_markers(_claude_code(turns[1], "5m"))
    system, last = core.pins.pin_marked(core.wrapper.tokens, pending.plan, marked, decode).made
    client.now += 1.0
    pending = _turn(core, turns[2])
    only_last = [Marker(len(turns[2]) - 1, 300.0, "5m")]
    outcome = core.pins.pin_marked(core.wrapper.tokens, pending.plan, only_last, decode)
    [moved] = outcome.made
    assert outcome.replaced == 1 and client.calls[-1] == ("unpin", {"pin_id": last.pin_id,
                                                                    "owner": None})  # fmt: skip
    assert core.pins.live() == [system, moved]  # the 1-hour one kept, not renewed
    edited = [{**turns[3][0], "content": "You are a terse engineer."}, *turns[3][1:]]
    pending = _turn(core, edited)
    assert pending.plan.directives  # spliced: the system prompt changed
    only_last = [Marker(len(edited) - 1, 300.0, "5m")]
    outcome = core.pins.pin_marked(core.wrapper.tokens, pending.plan, only_last, decode)
    [fresh] = outcome.made
    assert outcome.replaced == 2 and core.pins.live() == [fresh]
    unpinned = [kw["pin_id"] for name, kw in client.calls if name == "unpin"][-2:]
    assert unpinned == [system.pin_id, moved.pin_id]


def test_a_refused_breakpoint_keeps_the_other_pins() -> None:
    client = FakeBackend()
    core = _core(client, "a", policy="none")
    decode = core.wrapper.renderer.decode
    turns = agent_conversation()
    pending = _turn(core, turns[1])
    system, last = core.pins.pin_marked(
        core.wrapper.tokens, pending.plan, cache_markers(_claude_code(turns[1], "5m")), decode
    ).made
    client.refuse = "pin"
    pending = _turn(core, turns[2])
    outcome = core.pins.pin_marked(
        core.wrapper.tokens, pending.plan, cache_markers(_claude_code(turns[2], "5m")), decode
    )
    assert outcome.made == [] and [e.status for e in outcome.refused] == [429, 429]
    assert core.pins.live() == [system, last]  # nothing released: they stay until their TTL
    assert "unpin" not in client.names()


def test_the_proxy_counts_every_pin_and_the_record_shows_each() -> None:
    client = FakeBackend()
    retention = Retention()
    reg = SessionRegistry(lambda key, salt: _core(client, key.public_id, "none"))
    turns = agent_conversation()
    session = reg.resolve(turns[1], header="h")
    for t in (1, 2):
        pending = _turn(session.core, turns[t])
        asyncio.run(retention.pin_turn(session, pending, cache_markers(_claude_code(turns[t]))))
    c = retention.counters
    assert (c.pins, c.pins_replaced, c.pins_refused, c.pin_errors) == (4, 2, 0, 0)
    record = session.summary()
    ends = [p["pinned_tokens"] for p in record["pins"]]
    assert [p["ttl_s"] for p in record["pins"]] == [3600.0, 3.0]
    assert ends == [pending.plan.spans[0][1], pending.plan.spans[-1][1]]
    assert record["pin"] == record["pins"][-1]
    assert set(record["pin"]) == {"pin_id", "pinned_tokens", "ttl_s", "expires_at"}
    client.now += 3.0  # the short pin expired on the server
    record = session.summary()
    assert [p["ttl_s"] for p in record["pins"]] == [3600.0] and record["pin"] == record["pins"][0]


def test_the_proxy_shutting_down_releases_every_live_sessions_pins() -> None:
    client = FakeBackend()
    retention = Retention()
    reg = SessionRegistry(lambda key, salt: _core(client, key.public_id, "none"))
    turns = agent_conversation()
    pinned, plain = reg.resolve(turns[1], header="a"), reg.resolve(turns[1], header="b")
    pending = _turn(pinned.core, turns[1])
    asyncio.run(retention.pin_turn(pinned, pending, cache_markers(_claude_code(turns[1], "1h"))))
    _turn(plain.core, turns[1])
    asyncio.run(retention.release_all(reg.sessions()))
    assert client.calls[-1] == ("unpin", {"pin_id": None, "owner": "leyline:a"})
    assert client.names().count("unpin") == 1  # the session without pins asks nothing
    assert pinned.core.pins.pins == {} and retention.counters.pins_released == 1
