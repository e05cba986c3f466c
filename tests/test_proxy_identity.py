"""Session identity, anonymous matching, tenants and keys of the proxy, without a backend.

The registry and the app run against a dead backend (or none at all); every assertion is on the
real value (ids, namespaces, file names, status codes, which session a request lands in).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
from fastapi.testclient import TestClient
from test_proxy import agent_conversation

from leyline_agent.backends.sglang.launch import free_port
from leyline_agent.client import LeylineClient
from leyline_agent.directive import Directive
from leyline_agent.proxy import SESSION_HEADER, SessionRegistry, TraceRecorder, create_app
from leyline_agent.proxy.auth import ApiKeys, parse_api_key
from leyline_agent.proxy.identity import SessionKey, match_form
from leyline_agent.session import SessionCore
from leyline_agent.wire import SpliceResponse
from leyline_agent.wrapper import ConversationWrapper


def _core(key: SessionKey, cache_salt: str | None = None) -> SessionCore:
    """The registry's ``new_core``: the key's namespaces, the salt it starts with."""
    return SessionCore(
        LeylineClient("http://127.0.0.1:9"),
        ConversationWrapper(),
        session_id=key.public_id,
        namespace=key.namespace,
        cache_salt=cache_salt,
        shared_namespace=key.shared_namespace,
    )


def _commit(session: Any, messages: list[dict[str, Any]]) -> None:
    """What ``SessionCore.finish`` leaves behind: the turn's messages as committed."""
    session.core.messages = [dict(m) for m in messages]


# --- identity is injective ------------------------------------------------------------------

TRICKY = [
    SessionKey("default", "header", "user:u1"),
    SessionKey("default", "user", "u1"),
    SessionKey("default", "header", "user%3Au1"),
    SessionKey("default", "user", "u1", "c1"),
    SessionKey("default", "user", "u1:c1"),
    SessionKey("default", "header", "user:u1:c1"),
    SessionKey("default", "cache_key", "k"),
    SessionKey("default", "header", "cache_key:k"),
    SessionKey("default", "user", "cache_key", "k"),
    SessionKey("default", "header", "anon:x"),
    SessionKey("default", "anon", "x"),
    SessionKey("a:b", "header", "c"),
    SessionKey("a", "header", "b:c"),
    SessionKey("a", "header", "header:c"),
    SessionKey("default", "header", "a/b"),
    SessionKey("default", "header", "a_b"),
    SessionKey("default", "header", "a b"),
    SessionKey("default", "header", "a%20b"),
    SessionKey("default", "header", "x" * 300),
    SessionKey("default", "header", "x" * 299 + "y"),
    SessionKey("default~x", "header", "y"),
    SessionKey("default", "header", "x~y"),
]


def test_namespaces_ids_and_record_files_never_collide(tmp_path: Path) -> None:
    namespaces = {k.namespace for k in TRICKY}
    ids = {(k.tenant, k.public_id) for k in TRICKY}
    recorder = TraceRecorder(tmp_path)
    paths = {recorder.path(k) for k in TRICKY}
    assert len(namespaces) == len(ids) == len(paths) == len(TRICKY)
    # the escaping is reversible (what makes it injective) and plain names stay readable
    assert SessionKey("t", "header", "dg-1a2b-splice-config").public_id == "dg-1a2b-splice-config"
    assert SessionKey("t", "header", "user:u1").public_id == "user%3Au1"
    assert SessionKey("t", "user", "u1").public_id == "user:u1"
    assert SessionKey("t", "user", "u1").namespace == "leyline:t:user:u1"
    assert SessionKey("a:b", "header", "c").namespace == "leyline:a%3Ab:header:c"
    assert SessionKey("t", "cache_key", "k:1").public_id == "cache_key:k%3A1"
    assert SessionKey("t", "cache_key", "k:1").namespace == "leyline:t:cache_key:k%3A1"
    assert SessionKey("t", "user", "u:1", "c").public_id == "user:u%3A1:c"
    assert SessionKey("t", "user", "u:1", "c").namespace == "leyline:t:user:u%3A1:c"
    for k in TRICKY:
        stem = recorder.path(k).name.removesuffix(".jsonl")
        assert len(recorder.path(k).name) < 200 and "/" not in stem
        if len(k.name) < 100:
            tenant, public_id = stem.split("+")
            assert (unquote(tenant), unquote(public_id)) == (k.tenant, k.public_id)


def test_header_cache_key_user_and_anonymous_names_are_four_sessions() -> None:
    reg = SessionRegistry(_core)
    m = [{"role": "user", "content": "hi"}]
    by_header = reg.resolve(m, header="user:u1")
    by_key = reg.resolve(m, cache_key="user:u1")
    by_user = reg.resolve(m, user="u1")
    assert len({id(by_header), id(by_key), id(by_user)}) == 3
    assert (by_header.id, by_key.id) == ("user%3Au1", "cache_key:user%3Au1")
    assert (by_header.source, by_key.source, by_user.source) == ("header", "cache_key", "user")
    # the user field is a scope: its conversation has a random id under the user's name
    conversation = by_user.key.conversation
    assert len(conversation) == 32 and by_user.id == f"user:u1:{conversation}"
    assert by_header.core.placement.own == "leyline:default:header:user%3Au1"
    assert by_key.core.placement.own == "leyline:default:cache_key:user%3Au1"
    assert by_user.core.placement.own == f"leyline:default:user:u1:{conversation}"
    assert by_user.summary()["user"] == "u1" and by_header.summary()["user"] is None
    anon = reg.resolve(m)
    assert anon.id.startswith("anon:") and anon.core.placement.own.startswith(
        "leyline:default:anon:"
    )
    # the public id of the anonymous session, sent back as a header, names a header session
    assert reg.resolve(m, header=anon.id) is not anon
    assert reg.get(by_user.id) is by_user and reg.get("user%3Au1") is by_header
    assert reg.get("cache_key:user%3Au1") is by_key
    # precedence: the header over prompt_cache_key over user
    assert reg.resolve(m, header="user:u1", cache_key="user:u1", user="u1") is by_header
    assert reg.resolve(m, cache_key="user:u1", user="u1") is by_key
    assert reg.named(cache_key="user:u1", user="u1") is by_key
    assert reg.named(user="u1") is None  # a user names no session


def test_one_user_two_conversations_are_two_sessions() -> None:
    """A chat front end (LibreChat) sends its user's id as ``user`` on every request: the user's
    conversations are told apart by their history, within the user's scope only."""
    reg = SessionRegistry(_core)
    system = {"role": "system", "content": "You are a helpful assistant."}
    a = [system, {"role": "user", "content": "Plan a trip to Lisbon in May."}]
    b = [system, {"role": "user", "content": "Explain the borrow checker in Rust."}]
    sessions: dict[str, list[Any]] = {"a": [], "b": []}
    for t in range(4):
        for name, history in (("a", a), ("b", b)):
            s = reg.resolve(history, user="u-42")
            _commit(s, history)
            sessions[name].append(s)
            history += [
                {"role": "assistant", "content": f"{name} answer {t}"},
                {"role": "user", "content": f"{name} follow-up {t}"},
            ]
    sa, sb = sessions["a"][0], sessions["b"][0]
    assert all(s is sa for s in sessions["a"]) and all(s is sb for s in sessions["b"])
    assert sa is not sb and sa.scope == sb.scope == "u-42" and sa.source == sb.source == "user"
    assert reg.created == 2
    # another user's identical history, or an anonymous one, never continues u-42's sessions
    other = reg.resolve(a, user="u-7")
    anon = reg.resolve(a)
    assert other not in (sa, sb) and anon not in (sa, sb, other)
    assert other.scope == "u-7" and anon.scope is None
    # a user's request with a session key names that session, not one of the user's history
    keyed = reg.resolve(a, cache_key="conv-1", user="u-42")
    assert keyed.key == ("default", "cache_key", "conv-1", "") and keyed.scope is None


def test_record_lines_carry_session_and_tenant(tmp_path: Path) -> None:
    recorder = TraceRecorder(tmp_path)
    a, b = SessionKey("default", "header", "user:u1"), SessionKey("default", "user", "u1")
    recorder.write(a, 0, [{"role": "user", "content": "from the header"}], None)
    recorder.write(b, 0, [{"role": "user", "content": "from the user field"}], None)
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["default+user%253Au1.jsonl", "default+user%3Au1.jsonl"]
    lines = [json.loads(f.read_text()) for f in files]
    assert [(x["session"], x["tenant"]) for x in lines] == [
        ("user%3Au1", "default"),
        ("user:u1", "default"),
    ]


# --- anonymous clients keep their cache ------------------------------------------------------


def _swe_agent_turns(n: int) -> list[list[dict[str, Any]]]:
    """SWE-agent's Anthropic-style prompts: text parts, the cache marker on the newest user
    message only (it moves every turn)."""
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are a coder."}]
    turns = []
    for t in range(n):
        if t:
            history.append({"role": "assistant", "content": f"thought {t}"})
        history.append({"role": "user", "content": f"observation {t}: " + "line\n" * 20})
        turns.append(_mark_last(history))
    return turns


def _mark_last(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(history):
        part: dict[str, Any] = {"type": "text", "text": m["content"]}
        if i == len(history) - 1:
            part["cache_control"] = {"type": "ephemeral"}
        out.append({"role": m["role"], "content": [part]})
    return out


def test_a_moving_cache_marker_stays_in_one_session() -> None:
    turns = _swe_agent_turns(4)
    assert turns[1][1] != turns[0][1]  # the marker moved off the old last message
    assert (
        match_form(turns[1][1])
        == match_form(turns[0][1])
        == turns[0][1] | {"content": turns[0][1]["content"][0]["text"]}
    )
    reg = SessionRegistry(_core)
    sessions = []
    for messages in turns:
        s = reg.resolve(messages)
        _commit(s, messages)
        sessions.append(s)
    assert all(s is sessions[0] for s in sessions) and sessions[0].source == "prefix"
    assert reg.created == 1


def test_an_edited_history_keeps_its_session_above_the_threshold() -> None:
    m = agent_conversation()[-1]  # system, user, 5 steps with tool outputs
    reg = SessionRegistry(_core)
    s = reg.resolve(m[:8])
    _commit(s, m[:8])
    edited = [dict(x) for x in m]
    edited[7] = {**edited[7], "content": "(output omitted)"}  # the agent trimmed an old output
    assert reg.resolve(edited) is s
    early = [dict(x) for x in m]
    early[1] = {**early[1], "content": "another task"}  # shares only the system prompt
    t = reg.resolve(early)
    assert t is not s and t.source == "new"


def test_two_runs_with_identical_histories_never_merge() -> None:
    """mini-swe-agent: run 2 starts with run 1's history; interleaved and one after the other."""
    turns = agent_conversation()
    reg = SessionRegistry(_core)
    run1, run2 = [], []
    for messages in turns:  # interleaved: run 1's turn, then run 2's identical turn
        for run in (run1, run2):
            s = reg.resolve(messages)
            _commit(s, messages)
            run.append(s)
    assert len({id(s) for s in run1}) == 1 and len({id(s) for s in run2}) == 1
    assert run1[0] is not run2[0]
    run3 = []
    for messages in turns:  # sequential: run 3 after runs 1 and 2 ended
        s = reg.resolve(messages)
        _commit(s, messages)
        run3.append(s)
    assert len({id(s) for s in run3}) == 1 and run3[0] not in (run1[0], run2[0])
    assert reg.created == 3


def test_a_session_with_a_turn_in_flight_takes_no_anonymous_request() -> None:
    import asyncio

    m = agent_conversation()[-1]
    reg = SessionRegistry(_core)
    s = reg.resolve(m[:2])
    _commit(s, m[:2])

    async def hold() -> Any:
        await s.lock.acquire()  # run 1's next turn is in flight
        try:
            return reg.resolve(m[:4])  # run 2's identical turn
        finally:
            s.lock.release()

    assert asyncio.run(hold()) is not s
    assert reg.resolve(m[:4]) is s


# --- tenants and cache_salt ------------------------------------------------------------------


def test_tenants_never_share_sessions() -> None:
    reg = SessionRegistry(_core)
    m = [{"role": "user", "content": "hi"}]
    a = reg.resolve(m, header="s1", tenant="alice")
    _commit(a, m)
    b = reg.resolve(m, header="s1", tenant="bob")
    assert a is not b and a.id == b.id == "s1"
    assert a.core.placement.own == "leyline:alice:header:s1" != b.core.placement.own
    assert reg.get("s1", "alice") is a and reg.get("s1", "bob") is b and reg.get("s1") is None
    anon = reg.resolve(m, tenant="alice")
    _commit(anon, m)
    longer = [*m, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    assert reg.resolve(longer, tenant="bob") is not anon
    assert reg.resolve(longer, tenant="alice") is anon
    assert {s.id for s in reg.sessions("bob")} == {"s1"} | {
        s.id for s in reg.sessions("bob") if s.id.startswith("anon:")
    }
    assert all(s.tenant == "alice" for s in reg.sessions("alice"))
    assert reg.created_in("alice") == 2


class _Recording(LeylineClient):
    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:9")
        self.splices: list[dict[str, Any]] = []

    def splice(self, tokens: Any, directives: Any, **kw: Any) -> SpliceResponse:
        self.splices.append(kw)
        return SpliceResponse(
            new_length=len(tokens), prefix_reused=0, prefilled=0, rotated=0, in_place=True,
            elapsed_ms=0.0,
        )  # fmt: skip


def test_cache_salt_is_one_namespace_for_the_chat_request_and_the_splice() -> None:
    client = _Recording()
    core = SessionCore(client, ConversationWrapper(policy="stale_tool_outputs:keep_last=2"))
    core.set_cache_salt("salt-1")
    turns = agent_conversation()
    shared, own = core.placement.shared, core.placement.own
    keys = []
    for messages in turns:
        pending = core.begin(messages)
        body = core.chat_body(pending, {"model": "m", "cache_salt": "salt-1"})
        assert body["cache_salt"] == "salt-1"
        keys.append(body["extra_key"])
        core.finish(pending, prompt_tokens=len(pending.plan.tokens), cached_tokens=0,
                    request_ms=0.0, messages=messages)  # fmt: skip
    # exact KV shared until the first splice, which builds the session's own path; then own
    first = keys.index(own)
    assert first > 0 and keys == [shared] * first + [own] * (len(keys) - first)
    where = [
        {k: kw[k] for k in ("extra_key", "cache_salt", "target_extra_key")} for kw in client.splices
    ]
    assert where[0] == {"extra_key": shared, "cache_salt": "salt-1", "target_extra_key": own}
    assert len(where) > 1 and all(
        w == {"extra_key": own, "cache_salt": "salt-1", "target_extra_key": None} for w in where[1:]
    )
    # every splice is versioned (issue 27 part 5): the state it was planned on, a key of its own
    keys_sent = [kw["idempotency_key"] for kw in client.splices]
    assert all(kw["expected_state"] for kw in client.splices) and len(set(keys_sent)) == len(
        keys_sent
    )
    core.set_cache_salt("salt-2")  # another namespace: nothing of salt-1 is reachable there
    assert core.wrapper.tokens == [] and core.placement.salt == "salt-2"
    assert core.placement.extra_key == shared  # nothing amortized under the new salt
    body = core.chat_body(core.begin(turns[1]), {"model": "m"})
    assert body["cache_salt"] == "salt-2"


def test_anonymous_matching_requires_the_same_salt() -> None:
    reg = SessionRegistry(_core)
    m = agent_conversation()[-1]
    s = reg.resolve(m[:2], cache_salt="a")
    _commit(s, m[:2])
    assert s.core.placement.salt == "a"
    assert reg.resolve(m[:4], cache_salt="b") is not s
    assert reg.resolve(m[:4]) is not s
    assert reg.resolve(m[:4], cache_salt="a") is s


def test_splice_sends_cache_salt_on_the_wire() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append({"auth": request.headers.get("authorization"), **json.loads(request.content)})
        return httpx.Response(409, json={"error": "not cached"})

    client = LeylineClient("http://backend", api_key="backend-key")
    client.http = httpx.Client(
        base_url="http://backend",
        transport=httpx.MockTransport(handler),
        headers=client.http.headers,
    )
    d = Directive(start=0, end=1, replacement=[5])
    with pytest.raises(Exception, match="409"):
        client.splice([1, 2], [d], extra_key="ns", cache_salt="s")
    assert (seen[0]["auth"], seen[0]["extra_key"], seen[0]["cache_salt"]) == (
        "Bearer backend-key",
        "ns",
        "s",
    )


# --- keys ------------------------------------------------------------------------------------


def test_api_key_specs() -> None:
    assert parse_api_key("sk-1=alice") == ("sk-1", "alice")
    assert parse_api_key("a=b=c") == ("a=b", "c")
    assert parse_api_key("YWJjZA==") == ("YWJjZA==", parse_api_key("YWJjZA==")[1])
    assert parse_api_key("YWJjZA===bob") == ("YWJjZA==", "bob")
    own = parse_api_key("sk-2")[1]
    assert own.startswith("key-") and len(own) == 16 and own != parse_api_key("sk-3")[1]
    keys = ApiKeys(["k1=alice", "k2=alice", "k3=bob"])
    assert keys.tenant("Bearer k1") == keys.tenant("bearer k2") == "alice"
    assert keys.tenant("Bearer k3") == "bob"
    assert keys.tenant("Bearer nope") is None and keys.tenant(None) is None
    assert keys.tenant("k1") is None and keys.tenant("Basic k1") is None
    with pytest.raises(ValueError, match="two tenants"):
        ApiKeys(["k=alice", "k=bob"])
    with pytest.raises(ValueError, match="empty"):
        ApiKeys([" "])
    assert not ApiKeys([])


def test_wrong_and_missing_keys_get_401_and_change_nothing() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    app = create_app(dead, "none", api_keys=["ka=alice", "kb=bob"], connect_timeout=1.0)
    reg = app.state.proxy.registry
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200  # open (probes)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "ka"}):
            for method, path in [
                ("POST", "/v1/chat/completions"),
                ("GET", "/v1/models"),
                ("GET", "/v1/models/m"),  # forwarded routes too
                ("POST", "/v1/completions"),
                ("GET", "/leyline/sessions"),
                ("GET", "/leyline/sessions/s1"),
                ("GET", "/metrics"),
            ]:
                r = http.request(method, path, json=chat, headers={SESSION_HEADER: "s1", **headers})
                assert r.status_code == 401, (path, headers)
                err = r.json()["error"]
                assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
                assert r.headers["www-authenticate"].startswith("Bearer")
        assert reg.created == 0 and reg.sessions() == []
        # with a key: the request goes through (to a dead backend: 502), in the key's tenant
        r = http.post(
            "/v1/chat/completions",
            json=chat,
            headers={"Authorization": "Bearer ka", SESSION_HEADER: "s1"},
        )
        assert r.status_code == 502 and r.headers[SESSION_HEADER] == "s1"
        assert [(s.tenant, s.id) for s in reg.sessions()] == [("alice", "s1")]
        as_bob = {"Authorization": "Bearer kb"}
        listing = http.get("/leyline/sessions", headers=as_bob).json()
        assert listing["tenant"] == "bob" and listing["sessions"] == []
        assert http.get("/leyline/sessions/s1", headers=as_bob).status_code == 404
        assert 'session="s1"' not in http.get("/metrics", headers=as_bob).text
        as_alice = {"Authorization": "Bearer ka"}
        assert [
            s["id"] for s in http.get("/leyline/sessions", headers=as_alice).json()["sessions"]
        ] == ["s1"]
        assert http.get("/leyline/sessions/s1", headers=as_alice).json()["tenant"] == "alice"
        r = http.post("/v1/chat/completions", json={**chat, "cache_salt": 3}, headers=as_alice)
        assert r.status_code == 400 and "cache_salt" in r.json()["error"]["message"]


def test_without_keys_everything_is_the_default_tenant() -> None:
    app = create_app(f"http://127.0.0.1:{free_port()}", "none", connect_timeout=1.0)
    with TestClient(app) as http:
        listing = http.get("/leyline/sessions").json()
        assert listing["tenant"] == "default" and listing["sessions"] == []


def test_the_backend_key_is_sent_upstream() -> None:
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"object": "list", "data": []})

    app = create_app("http://backend", "none", backend_api_key="bk", api_keys=["ck=t"])
    proxy = app.state.proxy
    proxy.http = httpx.AsyncClient(
        base_url="http://backend",
        transport=httpx.MockTransport(handler),
        headers=proxy.http.headers,
    )
    assert proxy.client.http.headers["authorization"] == "Bearer bk"
    with TestClient(app) as http:
        r = http.get("/v1/models", headers={"Authorization": "Bearer ck"})
    assert r.status_code == 200 and seen == ["Bearer bk"]  # the client's own key never goes up


def window_turns(n: int, keep: int = 2, lines: int = 20) -> list[list[dict[str, Any]]]:
    """An agent with a sliding window: its system prompt, its last ``keep`` exchanges (user,
    assistant) and the new user message."""
    system = {"role": "system", "content": "You are a coder. " * 8}
    done: list[list[dict[str, Any]]] = []
    turns = []
    for t in range(n):
        user = {"role": "user", "content": f"observation {t}: " + f"line {t}\n" * lines}
        turns.append([system, *(m for pair in done[-keep:] for m in pair), user])
        done.append([user, {"role": "assistant", "content": f"thought {t}"}])
    return turns


def test_a_sliding_window_stays_in_one_session() -> None:
    """An unnamed agent that drops its oldest messages every turn (keeping its system prompt)
    continues its session: the kept run counts as shared (before: a new session every turn
    once the window was full, as only the system prompt was a common prefix)."""
    turns = window_turns(6)
    assert turns[3][1] != turns[2][1] and turns[3][1:3] == turns[2][3:5]  # the window slid
    reg = SessionRegistry(_core)
    sessions = []
    for messages in turns:
        s = reg.resolve(messages)
        _commit(s, messages)
        sessions.append(s)
    assert all(s is sessions[0] for s in sessions) and reg.created == 1
    # a window of another conversation (another system prompt, other messages) is not it
    other = [{**m, "content": m["content"] + " (other)"} for m in turns[-1]]
    assert reg.resolve(other) is not sessions[0]
    # the same window again (another run, or a retry) is never merged into it
    assert reg.resolve(turns[-1]) is not sessions[0]


def test_a_retry_goes_to_the_session_of_its_first_attempt() -> None:
    """openai-python resends a request after a timeout with ``x-stainless-retry-count: 1``: the
    retry waits for its first attempt's session (in flight or finished), never a second
    session; without the count an identical request is another run of the agent, as before."""
    import asyncio

    from leyline_agent.proxy.identity import session_keys

    assert session_keys({}, {"x-stainless-retry-count": "1"}).retry
    assert not session_keys({}, {"x-stainless-retry-count": "0"}).retry
    assert not session_keys({}, {"x-stainless-retry-count": "x"}).retry
    m = agent_conversation()[-1]
    reg = SessionRegistry(_core)
    s = reg.resolve(m[:2])
    _commit(s, m[:2])
    first = reg.resolve(m[:4])
    assert first is s

    async def in_flight() -> tuple[Any, Any]:
        await s.lock.acquire()  # the first attempt's turn is in flight
        try:
            retried = reg.resolve(m[:4], retry=True)
            return retried, reg.resolve(m[:4], retry=True, user="u")  # (another scope)
        finally:
            s.lock.release()

    retried, scoped = asyncio.run(in_flight())
    assert retried is s and scoped is not s
    _commit(s, m[:4])  # the first attempt finished
    assert reg.resolve(m[:4], retry=True) is s
    other = reg.resolve(m[:4])  # no retry count: another run of the agent
    assert other is not s and other.scope is None
    assert reg.resolve(m[:6], retry=True) is s  # a retry nothing matches: as usual


def test_a_regenerate_in_a_users_scope_continues_the_conversation() -> None:
    """A chat front end's "regenerate" sends the user's last request again: within a user's
    scope (one person, not parallel runs of an agent) it continues its conversation; an
    anonymous identical request is still another run."""
    m = agent_conversation()[-1]
    reg = SessionRegistry(_core)
    s = reg.resolve(m[:4], user="u")
    _commit(s, m[:4])
    assert reg.resolve(m[:4], user="u") is s  # regenerate
    assert reg.resolve(m[:6], user="u") is s  # and on
    anon = reg.resolve(m[:4])
    _commit(anon, m[:4])
    assert reg.resolve(m[:4]) is not anon
