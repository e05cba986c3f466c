"""Versioned, idempotent splices (issue 27 part 5): state ids, ``expected_state``, idempotency
keys, the evidence a splice answers with; at the wire level, against the session's real
``leyline serve``, and through the proxy's session code path."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from live import assert_integrity, gen, ns, seq, splice, stats
from pydantic import ValidationError
from test_proxy import POLICY, TOOLS, agent_conversation, expected_plans

from leyline_agent.api import LeylineSession
from leyline_agent.backends.sglang.errors import SpliceError
from leyline_agent.backends.sglang.versions import ReplayStore, check_expected_state
from leyline_agent.client import LeylineClient, SpliceRejected
from leyline_agent.directive import Directive
from leyline_agent.wire import SpliceRequest, SpliceResponse, splice_key, state_id

# ---- wire level ------------------------------------------------------------------------------


def test_state_id_names_tokens_and_namespace() -> None:
    a = state_id([1, 2, 3], "ns")
    assert len(a) == 32 and int(a, 16) >= 0
    assert a == state_id([1, 2, 3], "ns") == state_id([1, 2, 3], "ns", "")
    others = {
        state_id([1, 2, 4], "ns"),
        state_id([1, 2, 3], "other"),
        state_id([1, 2, 3], None),
        state_id([1, 2, 3], "ns", "salt"),
        state_id([1, 2, 3, 0], "ns"),
    }
    assert len(others) == 5 and a not in others


def req(**kw: Any) -> SpliceRequest:
    body = {
        "tokens": [5, 6, 7, 8],
        "directives": [{"start": 1, "end": 2, "replacement": [9]}],
        "extra_key": "k",
    }
    return SpliceRequest.model_validate({**body, **kw})


def test_digest_leaves_the_key_out_and_sees_every_other_field() -> None:
    assert req(idempotency_key="a").digest() == req(idempotency_key="b").digest() == req().digest()
    assert req().digest() != req(extra_key="other").digest()
    assert req().digest() != req(directives=[{"start": 1, "end": 2, "replacement": [10]}]).digest()


def test_expected_state_is_validated_and_checked() -> None:
    with pytest.raises(ValidationError):
        req(expected_state="not-hex")
    with pytest.raises(ValidationError):
        req(idempotency_key="")
    good = state_id([5, 6, 7, 8], "k")
    assert check_expected_state(req(expected_state=good)) == good
    assert check_expected_state(req()) == good  # no expectation: the parent's id all the same
    stale = state_id([5, 6, 7], "k")
    with pytest.raises(SpliceError) as e:
        check_expected_state(req(expected_state=stale))
    assert e.value.status == 409 and stale in str(e.value) and good in str(e.value)


def test_replay_store_same_body_replays_other_body_conflicts_and_is_bounded() -> None:
    now = [0.0]
    store = ReplayStore(max_keys=2, ttl_s=10, clock=lambda: now[0])
    first = req(idempotency_key="k1")
    assert store.replay(first) is None
    store.remember(first, json.dumps({"new_length": 4, "replayed": False}))
    assert json.loads(store.replay(req(idempotency_key="k1")) or "{}") == {
        "new_length": 4,
        "replayed": True,
    }
    with pytest.raises(SpliceError) as e:
        store.replay(req(idempotency_key="k1", tokens=[5, 6, 7, 9]))
    assert e.value.status == 409 and "another splice body" in str(e.value)
    # the same key in another namespace is another key
    assert store.replay(req(idempotency_key="k1", extra_key="other")) is None
    # no key: nothing kept
    store.remember(req(), "{}")
    assert len(store) == 1
    # bounded: the oldest goes first
    store.remember(req(idempotency_key="k2"), "{}")
    store.remember(req(idempotency_key="k3"), "{}")
    assert len(store) == 2 and store.replay(req(idempotency_key="k1")) is None
    # TTL
    now[0] = 11.0
    assert store.replay(req(idempotency_key="k3")) is None


def test_splice_key_is_deterministic_per_state_edit_and_target() -> None:
    d = [Directive(start=1, end=2, replacement=[9])]
    k = splice_key("a" * 32, d, None)
    assert k == splice_key("a" * 32, d, None)
    assert k != splice_key("b" * 32, d, None) != splice_key("a" * 32, d, "t")
    assert k != splice_key("a" * 32, [Directive(start=1, end=2, replacement=[8])], None)


class DropFirst(BaseHTTPRequestHandler):
    """A scripted stand-in for ``leyline serve`` on loopback: the first splice's connection is
    closed without an answer (a lost reply), the next one answered; every body is recorded."""

    bodies: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        if len(type(self).bodies) == 1:
            self.close_connection = True
            self.connection.shutdown(2)
            return
        answer = SpliceResponse(
            new_length=4, prefix_reused=1, prefilled=1, rotated=2, in_place=True,
            elapsed_ms=1.0, replayed=True,
        ).model_dump_json().encode()  # fmt: skip
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def drop_first_server() -> Iterator[str]:
    DropFirst.bodies = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), DropFirst)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_client_resends_a_lost_splice_with_the_same_key_and_body_scripted_server(
    drop_first_server: str,
) -> None:
    d = [Directive(start=1, end=2, replacement=[9])]
    with LeylineClient(drop_first_server, timeout=10) as c:
        out = c.splice([5, 6, 7, 8], d, extra_key="k", idempotency_key="key-1")
    assert out.replayed and out.new_length == 4
    assert len(DropFirst.bodies) == 2 and DropFirst.bodies[0] == DropFirst.bodies[1]
    assert DropFirst.bodies[0]["idempotency_key"] == "key-1"
    # without a key a lost answer is not resent (it may have been applied)
    DropFirst.bodies = []
    with LeylineClient(drop_first_server, timeout=10) as c, pytest.raises(SpliceRejected) as e:
        c.splice([5, 6, 7, 8], d, extra_key="k")
    assert e.value.status == 0 and len(DropFirst.bodies) == 1


# ---- live: the session's real leyline serve -------------------------------------------------


@pytest.fixture(scope="module")
def http(leyline_server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=leyline_server, timeout=600) as c:
        yield c


EDIT = [{"start": 16, "end": 48, "replacement": seq(8, 99), "mode": "amortize"}]


@pytest.mark.sglang
def test_splice_answers_its_state_ids_and_evidence(http: httpx.Client) -> None:
    key = ns()
    toks = seq(64, 1)
    gen(http, toks, key)
    before = stats(http)
    r = splice(http, toks, EDIT, key)
    assert r.status_code == 200, r.text
    out = r.json()
    new = toks[:16] + EDIT[0]["replacement"] + toks[48:]
    assert out["parent_state_id"] == state_id(toks, key)
    assert out["state_id"] == state_id(new, key)
    # in place: 8 replacement slots prefilled, the 32 removed slots freed, 16 rows rotated
    assert (out["slots_allocated"], out["slots_freed"]) == (8, 32), out
    assert (out["prefix_reused"], out["rotated"], out["copied"]) == (16, 16, 0), out
    after = stats(http)
    assert_integrity(after)
    assert after["cached"] - before["cached"] == 8 - 32
    assert out["replayed"] is False
    assert gen(http, new, key)["cached_tokens"] == len(new) - 1


@pytest.mark.sglang
def test_identical_retry_replays_without_applying_twice(http: httpx.Client) -> None:
    key = ns()
    toks = seq(64, 2)
    gen(http, toks, key)
    first = splice(http, toks, EDIT, key, idempotency_key="retry-1")
    assert first.status_code == 200, first.text
    mid = stats(http)
    again = splice(http, toks, EDIT, key, idempotency_key="retry-1")
    assert again.status_code == 200, again.text
    a, b = first.json(), again.json()
    assert b["replayed"] is True and {**a, "replayed": True} == b
    after = stats(http)
    assert_integrity(after)
    assert (after["free"], after["cached"]) == (mid["free"], mid["cached"])
    # the same key with another body: 409, nothing changed
    other = [{**EDIT[0], "replacement": seq(8, 100)}]
    conflict = splice(http, toks, other, key, idempotency_key="retry-1")
    assert conflict.status_code == 409 and "another splice body" in conflict.json()["error"]
    assert (stats(http)["free"], stats(http)["cached"]) == (mid["free"], mid["cached"])
    # without a key the retry is a new splice: the old sequence was taken in place (409)
    assert splice(http, toks, EDIT, key).status_code == 409


@pytest.mark.sglang
def test_expected_state_stale_is_409_and_changes_nothing(http: httpx.Client) -> None:
    key = ns()
    toks = seq(64, 3)
    gen(http, toks, key)
    before = stats(http)
    stale = splice(http, toks, EDIT, key, expected_state=state_id(toks[:-1], key))
    assert stale.status_code == 409 and "stale state" in stale.json()["error"], stale.text
    assert (stats(http)["free"], stats(http)["cached"]) == (before["free"], before["cached"])
    ok = splice(http, toks, EDIT, key, expected_state=state_id(toks, key))
    assert ok.status_code == 200 and ok.json()["parent_state_id"] == state_id(toks, key)
    # the state is gone from the cache now (taken in place): the same expectation is a 409
    gone = splice(http, toks, EDIT, key, expected_state=state_id(toks, key))
    assert gone.status_code == 409 and "not cached" in gone.json()["error"]
    assert_integrity(stats(http))


@pytest.mark.sglang
def test_sessions_splice_with_state_ids_and_keys_and_record_the_chain(
    leyline_server: str,
) -> None:
    """The proxy's code path (``SessionCore`` under ``LeylineSession``): every splice carries the
    held tokens' state as ``expected_state`` and a deterministic key; the chain is recorded and
    each new state is the spliced prefix the backend now holds."""
    turns = agent_conversation()
    plans = expected_plans(POLICY, turns)
    session = LeylineSession(leyline_server, POLICY)
    for messages in turns:
        session.chat(messages, tools=TOOLS, max_tokens=1, temperature=0)
    states = list(session.core.states)
    spliced = [t for t, p in enumerate(plans) if p.directives]
    assert [s["turn"] for s in states] == spliced and len(spliced) == 3
    where = session.core.placement
    for s in states:
        plan = plans[s["turn"]]
        held = plan.tokens[: len(plan.tokens) - len(plan.tail)]
        assert s["state_id"] == state_id(held, where.extra_key, where.salt), s
        assert s["replayed"] is False and s["parent_state_id"] != s["state_id"]
    assert all(r.splice_error is None for r in session.records)
