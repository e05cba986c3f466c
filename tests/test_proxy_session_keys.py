"""The session keys clients really send, bad text and ``developer`` messages (issue 24, part 3).

- ``prompt_cache_key`` names a session; precedence ``X-Leyline-Session`` > ``prompt_cache_key`` >
  the ``user`` scope > anonymous (``identity.session_keys``);
- ``user`` names an end user, not a conversation: a chat front end that sends its user's id on
  every request (LibreChat) gets one session per conversation (told apart by history);
- a lone surrogate anywhere in a request's text is a 400 before any splice (was a 500);
- ``role: "developer"`` is served as the template's system role, on the proxy and in process.

Live tests run the real proxy (uvicorn on loopback) in front of the session's ``leyline serve``,
with the real ``openai`` client or raw httpx where the client cannot send the body.
"""

from __future__ import annotations

import json
import random
import uuid
from typing import Any

import httpx
import openai
import pytest
from starlette.datastructures import Headers
from test_proxy import (
    POLICY,
    SYSTEM,
    TOOLS,
    agent_conversation,
    expected_plans,
    new_id,
    openai_client,
    run_turns,
    serve_proxy,
    session_detail,
)

from leyline_agent.api import LeylineSession
from leyline_agent.chat.openai import chat_request_view, renders_developer
from leyline_agent.chat.request import request_error
from leyline_agent.chat_turn import RequestRefused
from leyline_agent.proxy import SESSION_HEADER
from leyline_agent.proxy.identity import SessionKeys, session_keys
from leyline_agent.wrapper import ConversationWrapper

# --- without a backend ----------------------------------------------------------------------


def test_session_keys_of_a_request() -> None:
    body = {"messages": [], "prompt_cache_key": "conv-9", "user": "u-1"}
    headers = Headers({"x-leyline-session": "s-1"})  # a request's headers: any case
    assert session_keys(body, headers) == SessionKeys("s-1", "conv-9", "u-1")
    assert session_keys(body, {}) == SessionKeys(None, "conv-9", "u-1")
    # not a non-empty string: absent (SGLang ignores both fields)
    odd = {"prompt_cache_key": 7, "user": ""}
    assert session_keys(odd, Headers({SESSION_HEADER: ""})) == SessionKeys(None, None, None)
    keys = session_keys(body, {})._asdict()
    assert keys == {"header": None, "cache_key": "conv-9", "user": "u-1", "retry": False}


BAD = "bytes \udcff here"  # what json.dumps writes as "\udcff" for surrogateescape'd bytes
CALL = {"id": "c1", "type": "function", "function": {"name": "sh", "arguments": "{}"}}


def _body(**over: Any) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "run it"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    return {"model": "m", "messages": messages, "tools": TOOLS, **over}


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (lambda b: b["messages"][2].update(content=BAD), "messages[2].content"),
        (lambda b: b["messages"][2].update(content=[{"type": "text", "text": BAD}]),
         "messages[2].content[0].text"),
        (lambda b: b["messages"][1]["tool_calls"][0]["function"].update(arguments='{"a": "\udcff"}'),
         "messages[1].tool_calls[0].function.arguments"),
        (lambda b: b["messages"][1]["tool_calls"][0]["function"].update(name="s\udcffh"),
         "messages[1].tool_calls[0].function.name"),
        (lambda b: b["tools"][0]["function"].update(description=BAD), "tools[0].function.description"),
        (lambda b: b["messages"][0].update(name="n\ud800"), "messages[0].name"),
        (lambda b: b.update(stop=["\udfff"]), "stop[0]"),
    ],
)  # fmt: skip
def test_text_that_is_not_unicode_is_refused_with_its_place(edit: Any, where: str) -> None:
    body = json.loads(json.dumps(_body()))
    assert request_error(body) is None
    edit(body)
    error = request_error(body)
    assert error is not None and f"lone surrogate) at {where} (character " in error
    assert error.isascii()  # the message itself is valid text
    assert request_error(_body(stop=["é 😀 \ue000"])) is None  # any valid text passes


def test_developer_is_sent_as_system_where_the_template_refuses_it() -> None:
    wrapper = ConversationWrapper()  # the embedded template: "unsupported message role"
    assert renders_developer(wrapper.renderer) is False
    dev = [{"role": "developer", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    sys_ = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    view, _ = chat_request_view(dev, None, developer_as_system=True)
    assert view == chat_request_view(sys_, None)[0]
    assert chat_request_view(dev, None)[0][0]["role"] == "developer"  # only when asked


def test_a_template_that_renders_developer_keeps_it() -> None:
    from leyline_agent.chat.render import Renderer

    tokenizer = ConversationWrapper().renderer.tokenizer
    generic = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    drops = (
        "{% for m in messages %}{% if m.role in ['system', 'user', 'assistant'] %}"
        "<|{{ m.role }}|>{{ m.content }}\n{% endif %}{% endfor %}"
    )
    assert renders_developer(Renderer(tokenizer, generic)) is True
    assert renders_developer(Renderer(tokenizer, drops)) is False  # dropped: sent as system


# --- live -----------------------------------------------------------------------------------


WORDS = (
    "tide turbine lagoon estuary barrage rotor grid storage flour starter crumb oven proof "
    "dough hydration yeast culture crust levain knead fold shape score steam bake cool slice "
    "river moon current energy power cable basin ocean wave salt water rye wheat spelt honey"
).split()


def _text(seed: str, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def _chat_turns(topic: str, n: int) -> list[list[dict[str, Any]]]:
    """A chat front end's requests for one conversation: the full history every turn (its own
    words, so that two conversations share no more than the system prompt)."""
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
        {"role": "user", "content": f"About {topic}: {_text(topic, 300)}"},
    ]
    turns = [list(history)]
    for t in range(1, n):
        history.append({"role": "assistant", "content": _text(f"{topic} answer {t}", 40)})
        history.append({"role": "user", "content": f"Follow-up {t}: {_text(f'{topic} {t}', 12)}"})
        turns.append(list(history))
    return turns


@pytest.mark.sglang
def test_one_user_two_conversations_prefill_only_their_tails(leyline_server: str) -> None:
    """The given case: LibreChat sends ``user: <user id>`` on every request; two conversations of
    one user, interleaved turn by turn. Each turn prefills its new tail only (before: both were
    one session and each turn spliced the other conversation away)."""
    a, b = _chat_turns("tidal energy", 4), _chat_turns("sourdough baking", 4)
    plans = {"a": expected_plans("none", a), "b": expected_plans("none", b)}
    user = f"librechat-{uuid.uuid4().hex[:8]}"
    with serve_proxy(leyline_server, "none") as proxy:
        client = openai_client(proxy)
        after: list[int] = []
        for t in range(4):
            for name, turns in (("a", a), ("b", b)):
                [(prompt, cached)] = run_turns(client, [turns[t]], user=user)
                assert prompt == len(plans[name][t].tokens)
                if t:  # all but the new tail is a hit
                    assert cached == prompt - len(plans[name][t].tail), (name, t, prompt, cached)
                after.append(prompt - cached)
        sessions = httpx.get(proxy + "/leyline/sessions", timeout=10).json()["sessions"]
        assert len(sessions) == 2 and {s["user"] for s in sessions} == {user}
        assert sorted(s["turns"] for s in sessions) == [4, 4]
        assert all(s["id"].startswith(f"user:{user}:") and s["source"] == "user" for s in sessions)
        assert sum(s["prefilled_tokens"] for s in sessions) == sum(after)
        # before: one session for the user (what `user` meant), the same requests
        one = {SESSION_HEADER: new_id("one-user")}
        for t in range(4):
            for turns in (a, b):
                run_turns(openai_client(proxy, **one), [turns[t]], user=user)
        records = session_detail(proxy, one[SESSION_HEADER])["records"]
    before = [r["prefilled_tokens"] for r in records]
    tails = sum(len(p.tail) for turns in plans.values() for p in turns[1:])
    firsts = sum(len(p[0].tokens) for p in plans.values())
    print(f"\none user, two conversations, after the first turns: prefilled {sum(before[2:])} as "
          f"one session, {sum(after[2:])} as two ({sum(before[2:]) / sum(after[2:]):.1f}x); "
          f"per turn {before} vs {after}")  # fmt: skip
    assert sum(after) == firsts + tails and sum(after[2:]) == tails
    assert all(records[t]["spliced"] for t in range(1, 8))  # each turn spliced the other away
    assert sum(before[2:]) > 5 * tails  # ~ the conversation length per turn against its tail


def _raw(proxy: str, sid: str, body: str) -> httpx.Response:
    return httpx.post(
        proxy + "/v1/chat/completions", content=body, timeout=120,
        headers={"content-type": "application/json", SESSION_HEADER: sid},
    )  # fmt: skip


@pytest.mark.sglang
def test_a_lone_surrogate_is_a_400_that_changes_nothing(leyline_server: str) -> None:
    """A tool output with ``\\udcff`` (escaped in the JSON, as ``json.dumps`` writes it): a 400
    in OpenAI's format (the ``error`` object; SGLang's fields too), before any splice; the
    session is unchanged and still usable. Before: a plain-text 500 (the tokenizer's TypeError),
    which openai-python retries twice."""
    turns = agent_conversation(3)
    plans = expected_plans(POLICY, turns)
    sid = new_id("surrogate")
    with serve_proxy(leyline_server, POLICY) as proxy:
        client = openai_client(proxy, **{SESSION_HEADER: sid})
        run_turns(client, turns[:2])
        before = session_detail(proxy, sid)
        bad = [dict(m) for m in turns[2]]
        bad[-1]["content"] += "\nbinary: \udcff\udcfe"
        body = json.dumps({"model": "default", "messages": bad, "tools": TOOLS, "max_tokens": 1})
        assert "\\udcff" in body and body.isascii()
        r = _raw(proxy, sid, body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == 400
        assert f"lone surrogate) at messages[{len(bad) - 1}].content (character" in err["message"]
        assert r.json()["message"] == err["message"]  # SGLang's own fields as well
        direct = httpx.post(leyline_server + "/v1/chat/completions", content=body, timeout=120,
                            headers={"content-type": "application/json"})  # fmt: skip
        assert direct.status_code == 400  # the backend refuses it too
        assert session_detail(proxy, sid) == before  # nothing changed
        unknown = _raw(proxy, new_id("surrogate-new"), body)
        assert unknown.status_code == 400
        assert len(httpx.get(proxy + "/leyline/sessions", timeout=10).json()["sessions"]) == 1
        # the session goes on: the same turn, decoded with errors="replace"
        [(prompt, cached)] = run_turns(client, [turns[2]])
        assert prompt == len(plans[2].tokens) and cached == prompt - len(plans[2].tail)
        detail = session_detail(proxy, sid)
        assert detail["turns"] == 3 and detail["records"][:2] == before["records"]
    # in process: LeylineSession.chat refuses it the same way, nothing sent, nothing recorded
    with LeylineSession(leyline_server, POLICY, share_exact=False) as session:
        session.chat(turns[1], tools=TOOLS, max_tokens=1)
        with pytest.raises(RequestRefused, match=r"lone surrogate\) at messages\["):
            session.chat(bad, tools=TOOLS, max_tokens=1)
        assert len(session.records) == 1
        data = session.chat(turns[2], tools=TOOLS, max_tokens=1)
        assert data["usage"]["prompt_tokens"] == len(plans[2].tokens)
        assert session.records[-1].render_mismatch is False


@pytest.mark.sglang
def test_developer_messages_are_served_and_spliced(leyline_server: str) -> None:
    """An agent whose instructions are ``role: "developer"`` (newer OpenAI clients): 200 on every
    turn, rendered as the backend computes it (the body forwarded carries ``system``), spliced
    on the policy's edits, no render mismatch. Before: 400 "unsupported message role"."""
    turns = agent_conversation()
    dev = [[{**m, "role": "developer"} if m["role"] == "system" else m for m in t] for t in turns]
    plans = expected_plans(POLICY, turns)  # what the template renders: the system role
    sid = new_id("developer")
    with serve_proxy(leyline_server, POLICY) as proxy:
        usage = run_turns(openai_client(proxy, **{SESSION_HEADER: sid}), dev)
        detail = session_detail(proxy, sid)
    assert [p for p, _ in usage] == [len(p.tokens) for p in plans]
    records = detail["records"]
    assert not any(r["render_mismatch"] or r["resynced"] for r in records)
    edited = [t for t, p in enumerate(plans) if p.directives]
    assert edited and all(records[t]["spliced"] for t in edited)
    for t, ((prompt, cached), plan) in enumerate(zip(usage, plans, strict=True)):
        if t:
            assert cached == prompt - len(plan.tail), (t, prompt, cached)
    # in process, the same
    with LeylineSession(leyline_server, "none", share_exact=False) as session:
        data = session.chat(dev[0], tools=TOOLS, max_tokens=1)
        assert data["usage"]["prompt_tokens"] == len(expected_plans("none", turns[:1])[0].tokens)
        assert session.records[0].render_mismatch is False


@pytest.mark.sglang
def test_prompt_cache_key_names_a_session(leyline_server: str) -> None:
    """``prompt_cache_key`` (the real client's parameter) names a session, under the header and
    over ``user``; SGLang accepts the field (it is forwarded)."""
    a, b = _chat_turns("estuary tides", 2), _chat_turns("rye starter", 2)
    key_a, key_b, user = new_id("conv-a"), new_id("conv-b"), new_id("u")
    plans = expected_plans("none", a)
    with serve_proxy(leyline_server, "none") as proxy:
        client = openai_client(proxy)
        usage = []
        for t in range(2):  # the same user, two keys: two sessions
            usage += run_turns(client, [a[t]], prompt_cache_key=key_a, user=user)
            run_turns(client, [b[t]], prompt_cache_key=key_b, user=user)
        assert usage[1][1] == usage[1][0] - len(plans[1].tail)
        for key in (key_a, key_b):
            detail = session_detail(proxy, f"cache_key:{key}")
            assert (detail["source"], detail["turns"], detail["user"]) == ("cache_key", 2, None)
        # the header wins over the key
        sid = new_id("header")
        r = openai_client(proxy, **{SESSION_HEADER: sid}).chat.completions.with_raw_response.create(
            model="default", messages=a[0], max_tokens=1, prompt_cache_key=key_a, user=user
        )
        assert r.headers[SESSION_HEADER] == sid
        assert session_detail(proxy, f"cache_key:{key_a}")["turns"] == 2
        ids = {
            s["id"] for s in httpx.get(proxy + "/leyline/sessions", timeout=10).json()["sessions"]
        }
        assert ids == {f"cache_key:{key_a}", f"cache_key:{key_b}", sid}


@pytest.mark.sglang
def test_a_sliding_window_client_is_one_spliced_session(leyline_server: str) -> None:
    """An unnamed client that drops its oldest exchange every turn (system prompt kept): one
    session; once the window is full each turn splices the dropped exchange out and prefills
    only its new tail (before: a new session, a cold prefill, every turn)."""
    from test_proxy_identity import window_turns

    turns = window_turns(6, keep=2, lines=30)
    plans = expected_plans("none", turns)
    with serve_proxy(leyline_server, "none") as proxy:
        usage = run_turns(openai_client(proxy), turns)
        [summary] = httpx.get(proxy + "/leyline/sessions", timeout=10).json()["sessions"]
        detail = session_detail(proxy, summary["id"])
    assert summary["source"] == "prefix" and summary["turns"] == 6
    records = detail["records"]
    print("\nsliding window: prompt/cached/prefilled per turn",
          [(p, c, r["prefilled_tokens"]) for (p, c), r in zip(usage, records, strict=True)])  # fmt: skip
    for t, ((prompt, cached), plan, rec) in enumerate(zip(usage, plans, records, strict=True)):
        assert prompt == len(plan.tokens) and not rec["render_mismatch"]
        if t >= 3:  # the window is full: the oldest exchange dropped, spliced out
            assert rec["spliced"] and rec["splice_error"] is None, (t, rec)
        if t >= 1:
            assert cached == prompt - len(plan.tail), (t, prompt, cached, len(plan.tail))


@pytest.mark.sglang
def test_a_retry_after_a_timeout_is_one_session_and_one_splice(leyline_server: str) -> None:
    """The real openai client times out on an edited turn and sends it again (its own retry,
    ``x-stainless-retry-count: 1``): the retry waits for the first attempt's session and repeats
    the turn as a full hit, without a splice (before: a second session, its history re-prefilled
    cold, and the agent's later turns split between the two)."""
    import time

    turns = agent_conversation()
    plans = expected_plans(POLICY, turns)
    assert not plans[2].directives and plans[3].directives  # turn 3 is edited: it splices
    with serve_proxy(leyline_server, POLICY) as proxy:
        run_turns(openai_client(proxy), turns[:3])
        hasty = openai.OpenAI(base_url=proxy + "/v1", api_key="unused", max_retries=1, timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            hasty.chat.completions.create(
                model="default", messages=turns[3], tools=TOOLS, max_tokens=400, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
        deadline = time.monotonic() + 120
        while True:
            sessions = httpx.get(proxy + "/leyline/sessions", timeout=10).json()["sessions"]
            if sum(s["turns"] for s in sessions) >= 5 and not any(s["in_flight"] for s in sessions):
                break
            assert time.monotonic() < deadline, sessions
            time.sleep(0.5)
        [summary] = sessions  # one session: the retry did not start a second one
        run_turns(openai_client(proxy), turns[4:5])  # the agent goes on in it
        records = session_detail(proxy, summary["id"])["records"]
    first, retry, after = records[3], records[4], records[5]
    assert first["spliced"] and first["directives_amortize"] == len(plans[3].directives)
    assert retry["prompt_tokens"] == first["prompt_tokens"] == len(plans[3].tokens)
    assert not retry["spliced"] and retry["directives_amortize"] == 0  # no second splice
    assert retry["server_cached_tokens"] >= retry["prompt_tokens"] - 1  # a full hit
    assert after["server_cached_tokens"] == after["prompt_tokens"] - len(plans[4].tail)


@pytest.mark.sglang
def test_parallel_sampling_counts_the_prompt_prefilled_once(leyline_server: str) -> None:
    """``n`` > 1: SGLang prefills the prompt once (a prefill-only warm-up it does not report),
    then samples n times, reporting the samples' cache hit. A cold prompt is prefilled once,
    in the answer's usage and in the record (before: cached = prompt - 1, prefilled 1)."""
    turns = _chat_turns("tidal lagoon", 2)
    plans = expected_plans("none", turns)
    sid = new_id("parallel")
    with serve_proxy(leyline_server, "none") as proxy:
        client = openai_client(proxy, **{SESSION_HEADER: sid})
        answers = [
            client.chat.completions.create(
                model="default", messages=m, tools=TOOLS, max_tokens=1, temperature=1, n=2
            )
            for m in turns
        ]
        records = session_detail(proxy, sid)["records"]
    cold, warm = answers[0].usage, answers[1].usage
    assert len(answers[0].choices) == 2 and cold.prompt_tokens == len(plans[0].tokens)
    assert cold.prompt_tokens_details.cached_tokens == 0  # the backend said prompt - 1
    assert records[0]["prefilled_tokens"] == cold.prompt_tokens  # once, not n times
    # the next turn: its history cached (the bound allows the 2 sampled tokens after it)
    hit = warm.prompt_tokens - len(plans[1].tail)
    assert hit <= warm.prompt_tokens_details.cached_tokens <= hit + 2
    assert records[1]["server_cached_tokens"] == warm.prompt_tokens_details.cached_tokens


@pytest.mark.sglang
def test_a_regenerate_under_a_user_stays_in_its_conversation(leyline_server: str) -> None:
    """A chat front end's "regenerate" (the same request again, ``user`` set): the same session,
    a full hit, no splice; the conversation goes on in it (before this: a second session of
    the user, its history prefilled cold in its own namespace)."""
    turns = _chat_turns("storm surge", 3)
    plans = expected_plans("none", turns)
    user = new_id("regen")
    with serve_proxy(leyline_server, "none") as proxy:
        client = openai_client(proxy)
        usage = run_turns(client, [turns[0], turns[1], turns[1], turns[2]], user=user)
        [summary] = httpx.get(proxy + "/leyline/sessions", timeout=10).json()["sessions"]
        records = session_detail(proxy, summary["id"])["records"]
    assert summary["turns"] == 4 and summary["user"] == user
    prompt, cached = usage[2]
    assert prompt == len(plans[1].tokens) and cached >= prompt - 1  # the regenerate: a hit
    assert not records[2]["spliced"] and records[2]["directives_amortize"] == 0
    assert usage[3][1] == usage[3][0] - len(plans[2].tail)
