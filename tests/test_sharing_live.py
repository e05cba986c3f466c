"""Sharing, isolation, pins and forks end to end: the real ``openai`` client through a real
``leyline proxy`` (uvicorn on loopback) in front of the shared ``leyline serve`` (16,384-token
pool, ``--max-pinned-fraction`` 0.5 by default), plus the pin and fork routes' refusals through
``LeylineClient``. Every test runs under a ``cache_salt`` of its own, so no other test's exact KV
is reachable from it (sharing is per tenant and salt)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import openai
import pytest
from live import seq
from test_proxy import (
    POLICY,
    TOOLS,
    agent_conversation,
    expected_plans,
    new_id,
    openai_client,
    run_turns,
    serve_proxy,
    session_detail,
)

from leyline_agent import LeylineSession
from leyline_agent.client import ForkRejected, LeylineClient, PinRejected
from leyline_agent.proxy import SESSION_HEADER
from leyline_agent.proxy.identity import FORK_HEADER

pytestmark = pytest.mark.sglang
SHARED = "leyline:default:shared"


def _system(words: int = 2700) -> str:
    """A system prompt of about 1.5 × ``words`` tokens (2700: ~4k), unique to the call."""
    tag = uuid.uuid4().hex[:8]
    return f"[{tag}] " + " ".join(f"rule{i % 97}: keep tests green" for i in range(words // 4))


def _ask(client: openai.OpenAI, messages: list[dict[str, Any]], salt: str) -> tuple[int, int]:
    r = client.chat.completions.create(
        model="default", messages=messages, max_tokens=1, temperature=0,
        extra_body={"cache_salt": salt},
    )  # fmt: skip
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens or 0


def _stats(url: str) -> dict[str, Any]:
    return httpx.get(url + "/leyline/stats", timeout=30).json()


def test_sessions_share_an_exact_system_prompt(leyline_server: str) -> None:
    """Two sessions with the same ~4k-token system prompt: the second one's first turn finds it
    cached (before: every session prefilled it in its own namespace)."""
    salt, system = new_id("salt"), _system()
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Fix test_a."}]
    second = [{"role": "system", "content": system}, {"role": "user", "content": "Fix test_b."}]
    with serve_proxy(leyline_server, "none", share_exact=True) as proxy:
        prompt_a, cached_a = _ask(
            openai_client(proxy, **{SESSION_HEADER: new_id("a")}), first, salt
        )
        prompt_b, cached_b = _ask(
            openai_client(proxy, **{SESSION_HEADER: new_id("b")}), second, salt
        )
    assert prompt_a > 3000 and cached_a == 0
    assert cached_b >= prompt_b - 12, (prompt_b, cached_b)  # all but the new user message
    salt2 = new_id("salt")
    with serve_proxy(leyline_server, "none", share_exact=False) as proxy:  # before this change
        _ask(openai_client(proxy, **{SESSION_HEADER: new_id("a")}), first, salt2)
        _, cold = _ask(openai_client(proxy, **{SESSION_HEADER: new_id("b")}), second, salt2)
    assert cold == 0


def test_amortized_kv_is_never_served_to_another_session(leyline_server: str) -> None:
    """A splices (its edited sequence lives in its own namespace); B sends exactly A's edited
    prompt: B reuses the shared exact prefix up to A's first edit, nothing past it."""
    salt, turns = new_id("salt"), agent_conversation()
    a, b = new_id("iso-a"), new_id("iso-b")
    plans = expected_plans(POLICY, turns[:4])
    start = plans[-1].directives[0].start  # A's first edit in turn 4
    with serve_proxy(leyline_server, POLICY, share_exact=True) as proxy:
        usage_a = run_turns(
            openai_client(proxy, **{SESSION_HEADER: a}), turns[:4], extra_body={"cache_salt": salt}
        )
        da = session_detail(proxy, a)
        assert da["spliced_turns"] == 1 and da["private"] and da["request_namespace"] != SHARED
        assert usage_a[-1][1] == usage_a[-1][0] - len(plans[-1].tail)  # A's own amortized hit
    with serve_proxy(leyline_server, "none", share_exact=True) as proxy:
        client = openai_client(proxy, **{SESSION_HEADER: b})
        [(prompt, cached)] = run_turns(
            client, [plans[-1].messages], extra_body={"cache_salt": salt}
        )
        db = session_detail(proxy, b)
    assert prompt == usage_a[-1][0] and not db["private"]
    assert 0 < cached <= start, (cached, start)  # the exact prefix only


def test_a_pinned_prefix_survives_pool_pressure(leyline_server: str) -> None:
    """Two sessions with ~2k-token prompts, one marked with ``cache_control``; 24k tokens of
    other traffic go through the 16k pool; the pinned one is still cached, the other is not."""
    salt = new_id("salt")
    pinned_id, plain_id = new_id("pinned"), new_id("plain")

    def convo(marked: bool) -> list[dict[str, Any]]:
        system: dict[str, Any] = {"role": "system", "content": _system(1300)}
        if marked:
            system["cache_control"] = {"type": "ephemeral", "ttl": "5m"}
        return [system, {"role": "user", "content": "Which test fails?"}]

    pinned, plain = convo(True), convo(False)
    before = _stats(leyline_server)["pinned_slots"]
    with serve_proxy(leyline_server, "none", share_exact=True) as proxy:
        cp, cu = (openai_client(proxy, **{SESSION_HEADER: s}) for s in (pinned_id, plain_id))
        _ask(cp, pinned, salt)
        _ask(cu, plain, salt)
        pin = session_detail(proxy, pinned_id)["pin"]
        assert pin is not None and pin["pinned_tokens"] > 1500
        assert set(pin) == {"pin_id", "pinned_tokens", "ttl_s", "expires_at"}  # the session's own
        assert pin["ttl_s"] == 300 and pin["expires_at"] > time.time()
        assert session_detail(proxy, plain_id)["pin"] is None
        assert _stats(leyline_server)["pinned_slots"] >= pin["pinned_tokens"]
        with LeylineClient(leyline_server) as c:
            for i in range(24):
                c.generate(seq(1000, 9000 + i), extra_key=new_id("flood"))
        _, cached_pinned = _ask(cp, pinned, salt)
        _, cached_plain = _ask(cu, plain, salt)
        assert cached_pinned >= pin["pinned_tokens"] - 1, (cached_pinned, pin)
        assert cached_plain < 100, cached_plain
        ended = httpx.delete(f"{proxy}/leyline/sessions/{pinned_id}", timeout=30)
        assert ended.status_code == 200
        metrics = httpx.get(f"{proxy}/metrics", timeout=30).text
    assert "leyline_proxy_pins_total 2" in metrics  # one per marked turn (renewed)
    assert "leyline_proxy_pins_replaced_total 1" in metrics  # the first, by the second
    assert _wait_unpinned(leyline_server, before)


def _wait_unpinned(url: str, before: int, timeout: float = 10.0) -> bool:
    """The session's pins are released in the background when it ends: the server is back to
    the ``before`` pinned slots."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _stats(url)["pinned_slots"] == before:
            return True
        time.sleep(0.2)
    return False


def test_pin_refusals_change_nothing(leyline_server: str) -> None:
    """Not cached (an unknown namespace) 409, TTL outside (0, 86400] 422, the cap 429 (the
    default --max-pinned-fraction 0.5 of 16,384 slots): each leaves the pins as they were; the
    proxy counts a capped pin and still answers the client's request."""
    owner = new_id("owner")
    with LeylineClient(leyline_server) as c:
        key = new_id("pins")
        seqs = [seq(3000, 700 + i) for i in range(3)]
        for s in seqs:
            c.generate(s, extra_key=key)
        before = _stats(leyline_server)["pinned_slots"]
        for call, status in [
            (lambda: c.pin(seqs[0], ttl_s=60, extra_key=new_id("unknown")), 409),
            (lambda: c.pin(seq(50, 1), ttl_s=60, extra_key=key), 409),
            (lambda: c.pin(seqs[0], ttl_s=0, extra_key=key), 422),
            (lambda: c.pin(seqs[0], ttl_s=86401, extra_key=key), 422),
            (lambda: c.unpin("no-such-pin"), 404),
        ]:
            with pytest.raises(PinRejected) as e:
                call()
            assert e.value.status == status
            assert _stats(leyline_server)["pinned_slots"] == before
        made = [c.pin(s, ttl_s=60, extra_key=key, owner=owner) for s in seqs[:2]]
        assert [m.pinned_tokens for m in made] == [3000, 3000]
        assert made[-1].pinned_slots == before + 6000 and made[-1].pin_cap_slots == 8192
        with pytest.raises(PinRejected) as e:
            c.pin(seqs[2], ttl_s=60, extra_key=key, owner=owner)
        assert e.value.status == 429 and e.value.reason == "pin_cap"
        assert _stats(leyline_server)["pinned_slots"] == made[-1].pinned_slots
        # through the proxy: a marked turn over the cap is answered, the refusal counted
        salt, sid = new_id("salt"), new_id("capped")
        marked = [
            {"role": "system", "content": _system(), "cache_control": {"type": "ephemeral"}},
            {"role": "user", "content": "hi"},
        ]
        with serve_proxy(leyline_server, "none", share_exact=True) as proxy:
            prompt, _ = _ask(openai_client(proxy, **{SESSION_HEADER: sid}), marked, salt)
            metrics = httpx.get(f"{proxy}/metrics", timeout=30).text
            detail = session_detail(proxy, sid)
        assert detail["pin"] is None
        error = detail["pin_error"]
        assert (error["turn"], error["status"], error["reason"]) == (0, 429, "pin_cap"), error
        assert prompt > 3000 and "leyline_proxy_pins_refused_total 1" in metrics
        assert c.unpin(owner=owner) == 2
        assert _stats(leyline_server)["pinned_slots"] == before


def test_fork_starts_a_child_warm_and_leaves_the_parent_intact(leyline_server: str) -> None:
    """The parent runs until it spliced (private); a child forked from it (named as its client
    sent ``X-Leyline-Session``, ``:`` and all) finds the parent's history cached; the child's own
    splices never touch the parent's KV."""
    salt, turns = new_id("salt"), agent_conversation()
    parent, child = new_id("parent") + ":main", new_id("child")
    parent_id = parent.replace(":", "%3A")  # its public id, as listed
    extra = {"extra_body": {"cache_salt": salt}}
    plans = expected_plans(POLICY, turns)
    with serve_proxy(leyline_server, POLICY, share_exact=True) as proxy:
        run_turns(openai_client(proxy, **{SESSION_HEADER: parent}), turns[:5], **extra)
        assert session_detail(proxy, parent)["private"]
        missing = httpx.post(
            f"{proxy}/v1/chat/completions",
            json={"model": "default", "messages": turns[5], "max_tokens": 1},
            headers={SESSION_HEADER: new_id("orphan"), FORK_HEADER: "no-such-session"},
        )
        assert missing.status_code == 404 and "no-such-session" in missing.text
        assert len(httpx.get(f"{proxy}/leyline/sessions").json()["sessions"]) == 1  # nothing made
        kid = openai_client(proxy, **{SESSION_HEADER: child, FORK_HEADER: parent})
        [(prompt, cached)] = run_turns(kid, [turns[5]], **extra)
        assert cached == prompt - len(plans[5].tail), (prompt, cached)  # warm: the parent's KV
        detail = session_detail(proxy, child)
        assert detail["forked_from"] == parent_id and detail["private"]
        assert session_detail(proxy, parent_id)["id"] == parent_id  # the listed id in the URL
        assert detail["spliced_turns"] == 1  # the child spliced in its own namespace
        # the parent's cache is intact: its own next turn is all cached but the new tail
        [(p_prompt, p_cached)] = run_turns(
            openai_client(proxy, **{SESSION_HEADER: parent}), [turns[5]], **extra
        )
        assert p_cached == p_prompt - len(plans[5].tail), (p_prompt, p_cached)
        assert "leyline_proxy_fork_copies_total 1" in httpx.get(f"{proxy}/metrics").text


def test_fork_routes_refuse_bad_input(leyline_server: str) -> None:
    with LeylineClient(leyline_server) as c:
        key = new_id("src")
        tokens = seq(300, 5)
        c.generate(tokens, extra_key=key)
        with pytest.raises(ForkRejected) as e:
            c.fork(tokens, extra_key=new_id("unknown"), target_extra_key=new_id("dst"))
        assert e.value.status == 409
        same = {"tokens": tokens, "extra_key": key, "target_extra_key": key}
        assert c.http.post("/leyline/fork", json=same).status_code == 422
        dst = new_id("dst")
        out = c.fork(tokens, extra_key=key, target_extra_key=dst)
        assert out.new_length == len(tokens) and out.copied == len(tokens)
        assert c.generate(tokens + [11], extra_key=dst).cached_tokens == len(tokens)


def test_in_process_fork_and_pin(leyline_server: str) -> None:
    salt = new_id("salt")
    turns = agent_conversation()
    before = _stats(leyline_server)["pinned_slots"]
    with LeylineSession(leyline_server, POLICY) as parent:
        for messages in turns[:5]:
            parent.chat(messages, tools=TOOLS, max_tokens=1, cache_salt=salt)
        assert parent.core.placement.private
        pin = parent.pin(ttl_s=30)
        assert pin.pinned_tokens == len(parent.core.wrapper.tokens)
        with parent.fork() as child:
            reply = child.chat(turns[5], tools=TOOLS, max_tokens=1, cache_salt=salt)
            usage = reply["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] > usage["prompt_tokens"] // 2
    assert _stats(leyline_server)["pinned_slots"] == before  # close() released the pin


def _wait_for(check: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


def test_each_breakpoint_keeps_its_own_ttl(leyline_server: str) -> None:
    """The given case of issue 25 (what Claude Code sends): ``ttl: "1h"`` on the system prompt,
    a short one (``"4s"``) on the last message. Before: one pin per session with the last
    marker's TTL, so seconds later the system prompt was no longer pinned (pinned slots -> 0).
    Now both are pinned, each for its own TTL: after the short one's expiry the server still
    pins exactly the system prefix, the session's record shows the 1-hour pin alone, and the
    next marked turn renews the system pin (its TTL starts again) and pins the new last
    message."""
    salt, sid = new_id("salt"), new_id("claude-code")
    system = {"role": "system", "content": _system(400),
              "cache_control": {"type": "ephemeral", "ttl": "1h"}}  # fmt: skip
    short = {"type": "ephemeral", "ttl": "4s"}
    first = [system, {"role": "user", "content": "Which test fails?", "cache_control": short}]
    base = _stats(leyline_server)
    with serve_proxy(leyline_server, "none", share_exact=True) as proxy:
        client = openai_client(proxy, **{SESSION_HEADER: sid})
        prompt, _ = _ask(client, first, salt)
        detail = session_detail(proxy, sid)
        stats = _stats(leyline_server)
        system_pin, last_pin = detail["pins"]
        assert (system_pin["ttl_s"], last_pin["ttl_s"]) == (3600, 4)
        s_tokens, l_tokens = system_pin["pinned_tokens"], last_pin["pinned_tokens"]
        assert 500 < s_tokens < l_tokens < prompt  # the system prefix; all but the reply's prompt
        assert detail["pin"] == last_pin  # the longest prefix, as before
        assert stats["pins"] - base["pins"] == 2
        assert stats["pinned_slots"] - base["pinned_slots"] == l_tokens  # nested: counted once
        print(f"\n[breakpoints] prompt {prompt}: pinned slots {stats['pinned_slots']} "
              f"(+{l_tokens}: system {s_tokens} 1h, last {l_tokens} 4s)")  # fmt: skip
        time.sleep(max(0.0, last_pin["expires_at"] - time.time()) + 0.5)
        after = _stats(leyline_server)
        print(
            f"[breakpoints] 0.5 s after the 4s pin's expiry: pinned slots "
            f"{after['pinned_slots']} (+{after['pinned_slots'] - base['pinned_slots']})"
        )
        assert after["pins"] - base["pins"] == 1
        assert after["pinned_slots"] - base["pinned_slots"] == s_tokens  # the 1-hour prefix
        detail = session_detail(proxy, sid)
        assert detail["pins"] == [system_pin] and detail["pin"] == system_pin
        assert system_pin["expires_at"] > time.time() + 3500
        # the next turn marks both again: the system pin renewed, the short one on the new end
        second = [system, {"role": "user", "content": "Which test fails?"},
                  {"role": "assistant", "content": "test_a."},
                  {"role": "user", "content": "Fix it.", "cache_control": short}]  # fmt: skip
        _ask(client, second, salt)
        renewed, moved = session_detail(proxy, sid)["pins"]
        assert renewed["pinned_tokens"] == s_tokens and renewed["pin_id"] != system_pin["pin_id"]
        assert renewed["expires_at"] > system_pin["expires_at"]  # its hour starts again
        assert moved["pinned_tokens"] > l_tokens and moved["ttl_s"] == 4
        stats = _stats(leyline_server)
        assert stats["pins"] - base["pins"] == 2  # the renewed one replaced, not added
        assert stats["pinned_slots"] - base["pinned_slots"] == moved["pinned_tokens"]
        metrics = httpx.get(f"{proxy}/metrics", timeout=30).text
        assert "leyline_proxy_pins_total 4" in metrics  # both breakpoints, both turns
        assert "leyline_proxy_pins_replaced_total 1" in metrics  # the renewed system pin
        ended = httpx.delete(f"{proxy}/leyline/sessions/{sid}", timeout=30)
        assert ended.status_code == 200
    assert _wait_for(lambda: _stats(leyline_server)["pins"] == base["pins"])
    assert _stats(leyline_server)["pinned_slots"] == base["pinned_slots"]


def test_more_than_four_breakpoints_are_refused_before_any_splice(leyline_server: str) -> None:
    """Anthropic refuses more than 4 blocks with ``cache_control`` (400); so does the proxy, in
    OpenAI's error format, before anything reaches the backend: the session has no turn."""
    sid, mark = new_id("five"), {"type": "ephemeral"}
    messages: list[dict[str, Any]] = [{"role": "system", "content": "s", "cache_control": mark}]
    for i in range(4):
        role = "user" if i % 2 == 0 else "assistant"
        messages.append({"role": role, "content": f"m{i}", "cache_control": mark})
    with serve_proxy(leyline_server, "none", share_exact=True) as proxy:
        client = openai_client(proxy, **{SESSION_HEADER: sid})
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="default", messages=messages, max_tokens=1)  # type: ignore[arg-type]
        assert e.value.status_code == 400
        assert "A maximum of 4 blocks with cache_control may be provided. Found 5." in str(e.value)
        detail = session_detail(proxy, sid)
        assert detail["turns"] == 0 and detail["pins"] == [] and detail["pin"] is None
        [(prompt, _)] = [_ask(client, messages[:4], new_id("salt"))]  # 4 are fine
        assert prompt > 0 and len(session_detail(proxy, sid)["pins"]) == 4


def test_in_process_session_pins_each_breakpoint(leyline_server: str) -> None:
    """``LeylineSession.chat`` pins every breakpoint after the turn, each for its own TTL: a
    1-hour tools-and-system prefix (a marked tool: the embedded ChatML template renders the tools
    inside the system message) and the 4 s last message; ``close()`` releases what is left."""
    salt = new_id("salt")
    tools = [{**TOOLS[0], "cache_control": {"type": "ephemeral", "ttl": "1h"}}, *TOOLS[1:]]
    messages = [{"role": "system", "content": _system(400)},
                {"role": "user", "content": "Which test fails?",
                 "cache_control": {"type": "ephemeral", "ttl": "4s"}}]  # fmt: skip
    base = _stats(leyline_server)
    with LeylineSession(leyline_server, "none") as session:
        session.chat(messages, tools=tools, max_tokens=1, cache_salt=salt)
        assert len(session.records) == 1 and session.pin_error is None
        tools_pin, last_pin = session.core.pins.live()
        assert (tools_pin.ttl_s, last_pin.ttl_s) == (3600, 4)
        text = session.core.wrapper.renderer.decode(
            session.core.wrapper.tokens[: tools_pin.pinned_tokens]
        )
        assert text.endswith("</tool_call><|im_end|>\n") and '"name": "run_tests"' in text
        assert _stats(leyline_server)["pins"] - base["pins"] == 2
        time.sleep(max(0.0, last_pin.expires_at - time.time()) + 0.5)
        after = _stats(leyline_server)
        assert after["pinned_slots"] - base["pinned_slots"] == tools_pin.pinned_tokens
        assert session.core.pins.live() == [tools_pin]
    assert _stats(leyline_server)["pins"] == base["pins"]  # close() released the 1-hour pin


def test_the_proxy_shutting_down_releases_its_sessions_pins(leyline_server: str) -> None:
    """A 1-hour pin would outlive the proxy by an hour (nothing could renew or release it, and
    it holds room under the server's cap): shutting down releases it."""
    marked = [{"role": "system", "content": _system(400),
               "cache_control": {"type": "ephemeral", "ttl": "1h"}},
              {"role": "user", "content": "hi"}]  # fmt: skip
    base = _stats(leyline_server)
    with serve_proxy(leyline_server, "none", share_exact=True) as proxy:
        _ask(openai_client(proxy, **{SESSION_HEADER: new_id("left")}), marked, new_id("salt"))
        assert _stats(leyline_server)["pins"] - base["pins"] == 1
    assert _stats(leyline_server)["pins"] == base["pins"]
    assert _stats(leyline_server)["pinned_slots"] == base["pinned_slots"]
