"""Sharing, pins and forks on the agent side, without a server: ``cache_control`` markers
(``markers.py``), a session's namespaces (shared until its first splice, then its own), its pins
(one per breakpoint; more in ``test_breakpoints.py``), ``adopt`` (a fork), the proxy registry's
fresh sessions, ends and drop hook, the proxy's pin counters and a session's ``pin``/``pin_error``
record, and how ``X-Leyline-Fork-From`` and ``/leyline/sessions/{id}`` name a session (the app in
front of a dead backend). The same behaviours against a real server:
``tests/test_sharing_live.py``."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from fastapi.testclient import TestClient
from test_proxy import agent_conversation

from leyline_agent.accounting import TurnRecord
from leyline_agent.backends.sglang.launch import free_port
from leyline_agent.chat.openai import chat_request_view
from leyline_agent.client import ForkRejected, LeylineClient, PinRejected
from leyline_agent.markers import DEFAULT_TTL_S, Marker, Ttl, cache_marker, marked_end, parse_ttl
from leyline_agent.proxy import SESSION_HEADER, SessionRegistry, create_app
from leyline_agent.proxy.identity import FORK_HEADER, SessionKey
from leyline_agent.proxy.metrics import render_retention
from leyline_agent.proxy.retention import Retention, RetentionCounters
from leyline_agent.retention import fork as fork_session
from leyline_agent.session import SessionCore
from leyline_agent.wire import ForkResponse, PinResponse, SpliceResponse
from leyline_agent.wrapper import ConversationWrapper

EPHEMERAL = {"type": "ephemeral"}


class FakeBackend(LeylineClient):
    """Records every Leyline call; splices, forks and pins succeed unless ``refuse`` names
    the call (then 409)."""

    def __init__(self, refuse: str = "") -> None:
        super().__init__("http://127.0.0.1:9")
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.refuse = refuse
        self.now = 1000.0  # the server's clock (Unix time): pins expire at now + ttl_s

    def splice(self, tokens: Any, directives: Any, **kw: Any) -> SpliceResponse:
        self.calls.append(("splice", kw))
        return SpliceResponse(
            new_length=len(tokens), prefix_reused=0, prefilled=0, rotated=0, in_place=True,
            elapsed_ms=0.0,
        )  # fmt: skip

    def fork(self, tokens: Any, **kw: Any) -> ForkResponse:
        self.calls.append(("fork", {"tokens": list(tokens), **kw}))
        if self.refuse == "fork":
            raise ForkRejected(409, "not cached")
        return ForkResponse(new_length=len(tokens), copied=len(tokens), elapsed_ms=1.0)

    def pin(self, tokens: Any, **kw: Any) -> PinResponse:
        n = sum(name == "pin" for name, _ in self.calls)
        self.calls.append(("pin", {"tokens": list(tokens), **kw}))
        if self.refuse == "pin":
            raise PinRejected(429, "8,107 of 8,192 slots pinned: over the cap")
        return PinResponse(
            pin_id=f"p{n}", pinned_tokens=len(tokens), ttl_s=kw["ttl_s"],
            expires_at=self.now + kw["ttl_s"],
            pinned_slots=len(tokens), pin_cap_slots=1000,
        )  # fmt: skip

    def unpin(self, pin_id: str | None = None, *, owner: str | None = None) -> int:
        self.calls.append(("unpin", {"pin_id": pin_id, "owner": owner}))
        return 1

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


def _core(client: LeylineClient, sid: str, policy: str = "stale_tool_outputs:keep_last=2"):
    core = SessionCore(client, ConversationWrapper(policy=policy), session_id=sid)
    if isinstance(client, FakeBackend):
        core.pins.clock = lambda: client.now
    return core


def _turn(core: SessionCore, messages: list[dict[str, Any]]):
    pending = core.begin(messages)
    core.finish(pending, prompt_tokens=len(pending.plan.tokens), cached_tokens=0,
                request_ms=0.0, messages=messages)  # fmt: skip
    return pending


# --- cache_control markers --------------------------------------------------------------------


@pytest.mark.parametrize(
    "ttl, seconds, note",
    [(None, DEFAULT_TTL_S, None), ("5m", 300.0, None), ("1h", 3600.0, None), ("90s", 90.0, None),
     (12, 12.0, None), ("90", 90.0, None), (" 1.5h ", 5400.0, None), ("1d", 86400.0, None),
     ("25h", 86400.0, "clamped"), ("2d", 86400.0, "clamped"), (90000, 86400.0, "clamped"),
     (10**400, 86400.0, "clamped"), ("abc", DEFAULT_TTL_S, "invalid"),
     ("0s", DEFAULT_TTL_S, "invalid"), (0, DEFAULT_TTL_S, "invalid"),
     ("-5m", DEFAULT_TTL_S, "invalid"), (True, DEFAULT_TTL_S, "invalid"),
     (float("nan"), DEFAULT_TTL_S, "invalid"), ("", DEFAULT_TTL_S, "invalid")],
)  # fmt: skip
def test_ttl_is_clamped_to_the_maximum_and_an_invalid_one_is_the_default_noted(
    ttl: Any, seconds: float, note: str | None
) -> None:
    assert parse_ttl(ttl) == Ttl(seconds, note)
    marked = {"role": "user", "content": "x", "cache_control": {**EPHEMERAL, "ttl": ttl}}
    assert cache_marker([marked]) == Marker(0, seconds, ttl, note)


def test_the_last_marked_message_is_the_marker_and_never_reaches_the_template() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "s", "cache_control": {**EPHEMERAL, "ttl": "1h"}},
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "text", "text": "b", "cache_control": EPHEMERAL}]},
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": "d", "cache_control": {"type": "persistent"}},  # not ours
    ]  # fmt: skip
    assert cache_marker(messages) == Marker(1, DEFAULT_TTL_S)
    assert cache_marker(messages[:1]) == Marker(0, 3600.0, "1h")
    assert cache_marker([{"role": "user", "content": "x"}]) is None
    view, _ = chat_request_view(messages, None)
    assert "cache_control" not in repr(view)
    assert messages[0]["cache_control"]["ttl"] == "1h"  # the input is left as it was


def test_marked_end_is_the_last_sent_message_at_or_before_the_marker() -> None:
    spans, sources = [(2, 5), (5, 9), (9, 14)], [0, 2, 3]  # message 1 was dropped by the policy
    assert [marked_end(spans, sources, i) for i in range(5)] == [5, 5, 9, 14, 14]
    assert marked_end(spans, [1, 2, 3], 0) == 0


# --- namespaces -------------------------------------------------------------------------------


def test_shared_until_the_first_splice_then_private() -> None:
    client = FakeBackend()
    core = _core(client, "a")
    namespaces = []
    for messages in agent_conversation():
        pending = core.begin(messages)
        namespaces.append(core.chat_body(pending, {})["extra_key"])
        core.finish(pending, prompt_tokens=len(pending.plan.tokens), cached_tokens=0,
                    request_ms=0.0)  # fmt: skip
    first = namespaces.index("leyline:a")
    assert namespaces[:first] == ["leyline:default:shared"] * first and core.placement.private
    splices = [kw for name, kw in client.calls if name == "splice"]
    assert splices[0]["target_extra_key"] == "leyline:a"
    assert splices[0]["extra_key"] == "leyline:default:shared"
    core.move(FakeBackend(), "down")  # failover: the new backend holds nothing private
    assert core.placement.extra_key == "leyline:default:shared" and core.pins.pinned is None


def test_sharing_off_is_the_own_namespace_from_the_first_request() -> None:
    core = SessionCore(FakeBackend(), ConversationWrapper(), session_id="a", share_exact=False)
    assert core.placement.private and core.placement.extra_key == "leyline:a"
    with pytest.raises(ValueError, match="shared namespace"):
        SessionCore(FakeBackend(), ConversationWrapper(), namespace="x", shared_namespace="x")


# --- pins -------------------------------------------------------------------------------------


def test_a_moved_marker_pins_the_new_prefix_first_then_releases_the_old_one() -> None:
    client = FakeBackend()
    core = _core(client, "a", policy="none")
    turns = agent_conversation()
    decode = core.wrapper.renderer.decode
    pending = _turn(core, turns[0])
    first = core.pins.pin_marked(core.wrapper.tokens, pending.plan, [Marker(0, 60.0)], decode)
    [made] = first.made
    assert made.pinned_tokens == pending.plan.spans[0][1] and first.replaced == 0
    pending = _turn(core, turns[1])
    last = Marker(len(turns[1]) - 1, 300.0)
    second = core.pins.pin_marked(core.wrapper.tokens, pending.plan, [last], decode)
    [moved] = second.made
    assert moved.pinned_tokens == pending.plan.spans[-1][1]
    assert (second.replaced, second.refused, second.stale) == (1, [], [])
    assert client.names() == ["pin", "pin", "unpin"]  # the new one first, then the old one
    assert client.calls[2][1] == {"pin_id": made.pin_id, "owner": None}
    pin = client.calls[1][1]
    assert (pin["owner"], pin["extra_key"], pin["ttl_s"]) == ("leyline:a", core.placement.extra_key,
                                                              300.0)  # fmt: skip
    assert core.pins.pinned == moved and core.pins.live() == [moved]
    assert core.pins.release() == 1 and core.pins.pinned is None
    assert client.calls[-1] == ("unpin", {"pin_id": None, "owner": "leyline:a"})


# --- forks ------------------------------------------------------------------------------------


def test_fork_of_a_shared_parent_copies_nothing() -> None:
    client = FakeBackend()
    parent, child = _core(client, "p", "none"), _core(client, "c", "none")
    _turn(parent, agent_conversation()[0])
    assert fork_session(child, parent) is None and "fork" not in client.names()
    assert child.wrapper.tokens == parent.wrapper.tokens and not child.placement.private
    assert child.placement.extra_key == parent.placement.extra_key
    turn = agent_conversation()[1]
    pending = child.begin(turn)
    assert len(pending.plan.tail) < len(pending.plan.tokens)  # diffs against the parent's history


def test_fork_of_a_private_parent_copies_its_kv_into_the_child() -> None:
    client = FakeBackend()
    parent, child = _core(client, "p"), _core(client, "c")
    for messages in agent_conversation():
        _turn(parent, messages)
    assert parent.placement.private
    copied = fork_session(child, parent)
    assert (
        copied is not None and child.placement.private and child.placement.extra_key == "leyline:c"
    )
    fork = client.calls[-1][1]
    assert fork == {"tokens": parent.wrapper.tokens, "extra_key": "leyline:p",
                    "target_extra_key": "leyline:c", "cache_salt": None}  # fmt: skip
    refused = FakeBackend(refuse="fork")
    cold = _core(refused, "d")
    parent.placement.bind(refused)
    with pytest.raises(ForkRejected):
        fork_session(cold, parent)
    assert cold.wrapper.tokens == [] and not cold.placement.private  # nothing adopted
    with pytest.raises(ValueError, match="itself"):
        fork_session(parent, parent)


# --- proxy registry ---------------------------------------------------------------------------


def test_registry_fresh_named_and_ended_sessions() -> None:
    dropped: list[str] = []
    reg = SessionRegistry(
        lambda key, salt: _core(FakeBackend(), key.public_id),
        max_sessions=2,
        on_drop=lambda s: dropped.append(s.id),
    )
    m = agent_conversation()[-1]
    a = reg.resolve(m[:2])
    a.core.messages = m[:2]
    assert reg.resolve(m) is a and reg.resolve(m, fresh=True) is not a
    assert a.core.placement.shared == SessionKey("default", "anon", "").shared_namespace
    named = reg.resolve(m, header="h")
    assert reg.named(header="h") is named and reg.named(user="h") is None
    assert len(dropped) == 1  # the least recently used of three, past max_sessions=2
    named.core.records.append(_record())
    reg.remove(named)
    assert dropped[-1] == "h" and reg.get("h") is None
    assert reg.totals().turns == 1  # an ended session's counters stay in the totals


def _record() -> TurnRecord:
    return TurnRecord(turn=0, prompt_tokens=10, server_cached_tokens=0, prefilled_tokens=10,
                      reused_tokens=0, best_reused_tokens=10)  # fmt: skip


def test_retention_metrics_parse() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    counters = RetentionCounters()
    counters.count(pins=2, pins_refused=1, forks=1, pins_replaced=1, pin_ttl_invalid=3)
    families = {f.name: f for f in text_string_to_metric_families(render_retention(counters))}
    assert families["leyline_proxy_pins"].samples[0].value == 2
    assert families["leyline_proxy_pins_refused"].samples[0].value == 1
    assert families["leyline_proxy_pins_replaced"].samples[0].value == 1
    assert families["leyline_proxy_pin_ttl_invalid"].samples[0].value == 3
    assert families["leyline_proxy_pin_ttl_clamped"].samples[0].value == 0
    assert "replaced pins are not counted" in families["leyline_proxy_pins_released"].documentation


# --- the proxy's pins: counters, the session's record -----------------------------------------


def test_proxy_pins_count_replacements_and_ttl_problems_and_show_the_last_refusal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = FakeBackend()
    retention = Retention()
    reg = SessionRegistry(lambda key, salt: _core(client, key.public_id, "none"))
    turns = agent_conversation()
    session = reg.resolve(turns[0], header="h")

    def marked_turn(i: int, ttl: Any) -> None:
        pending = _turn(session.core, turns[i])
        mark = {"role": "user", "content": "x", "cache_control": {**EPHEMERAL, "ttl": ttl}}
        marker = cache_marker([*turns[i][:-1], mark])
        assert marker is not None
        asyncio.run(retention.pin_turn(session, pending, [marker]))

    with caplog.at_level(logging.WARNING, logger="leyline_agent.proxy.retention"):
        marked_turn(0, "25h")
        marked_turn(1, "abc")
    c = retention.counters
    # the 24-hour pin stays: the 300 s one covering it would not keep it as long
    assert (c.pins, c.pins_replaced, c.pin_ttl_clamped, c.pin_ttl_invalid) == (2, 0, 1, 1)
    assert [kw["ttl_s"] for name, kw in client.calls if name == "pin"] == [86400.0, DEFAULT_TTL_S]
    assert "'25h' is above the maximum" in caplog.text and "'abc' is malformed" in caplog.text
    pin = session.summary()["pin"]
    assert pin == {"pin_id": "p1", "pinned_tokens": len(client.calls[-1][1]["tokens"]),
                   "ttl_s": DEFAULT_TTL_S, "expires_at": 1000.0 + DEFAULT_TTL_S}  # fmt: skip
    assert [p["pin_id"] for p in session.summary()["pins"]] == ["p0", "p1"]
    assert session.summary()["pins"][-1] == pin
    assert session.summary()["pin_error"] is None
    client.refuse = "pin"
    marked_turn(2, "5m")
    record = session.summary()
    assert record["pin"]["pin_id"] == "p1"  # the previous pin stays
    assert record["pin_error"] == {"turn": 2, "status": 429, "reason": "pin_cap",
                                   "message": "8,107 of 8,192 slots pinned: over the cap"}  # fmt: skip
    assert (c.pins, c.pins_refused, c.pins_replaced) == (2, 1, 0)
    client.refuse = ""
    marked_turn(3, None)
    assert session.summary()["pin_error"] is None and c.pins_replaced == 1  # p1, covered by p3
    assert [p["ttl_s"] for p in session.summary()["pins"]] == [86400.0, DEFAULT_TTL_S]


# --- naming a session: X-Leyline-Fork-From, /leyline/sessions/{id} ----------------------------


def test_a_session_is_found_by_its_listed_id_or_the_name_its_client_sent() -> None:
    app = create_app(f"http://127.0.0.1:{free_port()}", "none", connect_timeout=1.0)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with TestClient(app) as http:
        r = http.post("/v1/chat/completions", json=chat, headers={SESSION_HEADER: "a:b"})
        assert r.status_code == 502  # the backend is dead; the session exists
        [listed] = [s["id"] for s in http.get("/leyline/sessions").json()["sessions"]]
        assert listed == r.headers[SESSION_HEADER] == "a%3Ab"
        for path in ("a%3Ab", "a:b", "a%253Ab"):  # as listed, as sent, the listed id escaped
            assert http.get(f"/leyline/sessions/{path}").json()["id"] == "a%3Ab", path
        missing = http.get("/leyline/sessions/x:y")
        assert missing.status_code == 404
        assert "'x:y'" in missing.text and "'x%3Ay'" in missing.text  # the ids tried
        # the fork header takes the name as sent in X-Leyline-Session, or the listed id
        for child, parent in (("c1", "a:b"), ("c2", "a%3Ab")):
            r = http.post(
                "/v1/chat/completions", json=chat,
                headers={SESSION_HEADER: child, FORK_HEADER: parent},
            )  # fmt: skip
            assert r.status_code == 502, r.text
            assert http.get(f"/leyline/sessions/{child}").json()["forked_from"] == "a%3Ab"
        r = http.post(
            "/v1/chat/completions", json=chat, headers={SESSION_HEADER: "c3", FORK_HEADER: "x:y"}
        )
        assert r.status_code == 404 and "'x:y'" in r.text and "'x%3Ay'" in r.text
        assert http.delete("/leyline/sessions/a%3Ab").json() == {"id": "a%3Ab", "ended": True}
        assert http.get("/leyline/sessions/a:b").status_code == 404
