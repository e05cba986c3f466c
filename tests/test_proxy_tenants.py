"""Keys, tenants, ``cache_salt`` and anonymous matching end to end, on a real ``leyline serve``.

The shared ``leyline_server`` fixture serves the tests without a backend key; ``keyed_server``
is a ``leyline serve --api-key`` of this module's own (one more server start, about a minute).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
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

from leyline_agent.client import LeylineClient
from leyline_agent.proxy import SESSION_HEADER

pytestmark = pytest.mark.sglang
BACKEND_KEY = "backend-secret"


@pytest.fixture(scope="module")
def turns() -> list[list[dict[str, Any]]]:
    return agent_conversation()


def _client(proxy: str, key: str | None = None, **headers: str) -> openai.OpenAI:
    client = openai_client(proxy, **headers)
    return client.with_options(api_key=key) if key else client


def test_cache_salt_reaches_the_splice(
    leyline_server: str, turns: list[list[dict[str, Any]]]
) -> None:
    """Chat request and splice both in (extra_key, cache_salt): every edited turn splices and
    every turn after the first caches all but its new tail (before: 409 on every splice)."""
    sid = new_id("salted")
    with serve_proxy(leyline_server, POLICY) as proxy:
        client = openai_client(proxy, **{SESSION_HEADER: sid})
        usage = run_turns(client, turns, extra_body={"cache_salt": "salt-1"})
        detail = session_detail(proxy, sid)
    plans = expected_plans(POLICY, turns)
    assert detail["spliced_turns"] == 3 and detail["splice_misses"] == 0
    assert [r["splice_error"] for r in detail["records"]] == [None] * len(turns)
    for t, ((prompt, cached), plan) in enumerate(zip(usage, plans, strict=True)):
        assert prompt == len(plan.tokens)
        assert cached == (prompt - len(plan.tail) if t else 0), (t, prompt, cached)


def _swe_agent(system: str, n: int, moving: bool) -> list[list[dict[str, Any]]]:
    """SWE-agent-style prompts: text parts, an Anthropic ``cache_control`` marker on the newest
    message (``moving``) or on the first user message only."""
    plain: list[dict[str, Any]] = [{"role": "system", "content": system}]
    turns = []
    for t in range(n):
        if t:
            plain.append({"role": "assistant", "content": f"I will look at file_{t}.py next."})
        plain.append({"role": "user", "content": f"OBSERVATION {t}\n" + "x = 1\n" * 60})
        marked = len(plain) - 1 if moving else 1
        turns.append(
            [
                {
                    "role": m["role"],
                    "content": [
                        {"type": "text", "text": m["content"]}
                        | ({"cache_control": {"type": "ephemeral"}} if i == marked else {})
                    ],
                }
                for i, m in enumerate(plain)
            ]
        )
    return turns


def test_an_anonymous_agent_with_a_moving_cache_marker_keeps_its_cache(
    leyline_server: str,
) -> None:
    with serve_proxy(leyline_server, "none") as proxy:
        http = httpx.Client(base_url=proxy, timeout=120)
        result = {}
        for moving in (True, False):
            # the same token count in both runs (' A' and ' B' are one token each); each proxy
            # gets fresh anonymous session ids, so nothing is shared with earlier runs
            system = f"You are SWE-agent (run {'A' if moving else 'B'})."
            rows = []
            for messages in _swe_agent(system, 4, moving):
                body = {"model": "default", "messages": messages, "max_tokens": 1}
                r = http.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                usage = r.json()["usage"]
                details = usage["prompt_tokens_details"]
                rows.append(
                    (r.headers[SESSION_HEADER], usage["prompt_tokens"], details["cached_tokens"])
                )
            result[moving] = rows
    for rows in result.values():
        assert len({sid for sid, _, _ in rows}) == 1  # one session for the whole run
    moving_usage = [(p, c) for _, p, c in result[True]]
    fixed_usage = [(p, c) for _, p, c in result[False]]
    assert moving_usage == fixed_usage  # the marker does not change the rendered prompt
    assert moving_usage[0][1] == 0 and all(c > 0.5 * p for p, c in moving_usage[1:])


def test_tenants_are_isolated_end_to_end(
    leyline_server: str, turns: list[list[dict[str, Any]]]
) -> None:
    keys = ["key-alice=alice", "key-bob=bob"]
    with serve_proxy(leyline_server, POLICY, api_keys=keys) as proxy:
        sid = new_id("shared-name")
        alice = _client(proxy, "key-alice", **{SESSION_HEADER: sid})
        bob = _client(proxy, "key-bob", **{SESSION_HEADER: sid})
        run_turns(alice, turns[:3])
        auth = {"Authorization": "Bearer key-alice"}
        before = httpx.get(f"{proxy}/leyline/sessions/{sid}", headers=auth).json()
        # bob names alice's session and sends her history: another session, nothing cached
        [(prompt, cached)] = run_turns(bob, [turns[2]])
        assert (prompt, cached) == (before["records"][2]["prompt_tokens"], 0)
        after = httpx.get(f"{proxy}/leyline/sessions/{sid}", headers=auth).json()
        assert after["records"] == before["records"] and after["turns"] == 3
        listing = httpx.get(
            f"{proxy}/leyline/sessions", headers={"Authorization": "Bearer key-bob"}
        ).json()
        assert [(s["id"], s["tenant"], s["turns"]) for s in listing["sessions"]] == [
            (sid, "bob", 1)
        ]
        assert listing["totals"]["turns"] == 1
        # wrong and missing keys: 401, nothing changes
        for key in ("key-mallory", None):
            client = _client(proxy, key, **{SESSION_HEADER: sid})
            if key is None:
                client = openai.OpenAI(
                    base_url=proxy + "/v1", api_key="", max_retries=0,
                    default_headers={SESSION_HEADER: sid},
                )  # fmt: skip
            with pytest.raises(openai.APIStatusError) as err:
                run_turns(client, [turns[3]])
            assert err.value.status_code == 401
        # alice continues: her cache and state are intact (all but the new tail cached)
        [(prompt, cached)] = run_turns(alice, [turns[3]])
        plan = expected_plans(POLICY, turns[:4])[3]
        assert cached == prompt - len(plan.tail)
        final = httpx.get(f"{proxy}/leyline/sessions/{sid}", headers=auth).json()
        assert final["turns"] == 4 and final["spliced_turns"] == 1 and final["splice_misses"] == 0


# --- a backend with its own key ---------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_server(leyline_server: str) -> Iterator[str]:
    from leyline_agent.backends.sglang.launch import EmbeddedServer

    with EmbeddedServer(max_total_tokens=16384, api_key=BACKEND_KEY) as srv:
        yield srv.url


def test_leyline_serve_api_key_protects_every_route(keyed_server: str) -> None:
    splice = {"tokens": [1, 2, 3], "directives": [{"start": 0, "end": 1, "replacement": [4]}]}
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        with httpx.Client(base_url=keyed_server, headers=headers, timeout=60) as http:
            assert http.post("/leyline/splice", json=splice).status_code == 401
            assert http.get("/leyline/stats").status_code == 401
            assert http.post("/v1/chat/completions", json=chat).status_code == 401
            assert http.post("/generate", json={"input_ids": [1, 2]}).status_code == 401
            assert http.get("/health").status_code == 200  # probes stay open
    client = LeylineClient(keyed_server, api_key=BACKEND_KEY)
    assert client.stats()  # with the key
    r = client.http.post("/leyline/splice", json=splice)
    assert r.status_code == 409  # past auth: the tokens are just not cached


def test_proxy_forwards_the_backend_key(
    keyed_server: str, turns: list[list[dict[str, Any]]]
) -> None:
    with serve_proxy(keyed_server, POLICY) as proxy:  # no --backend-api-key: the backend's 401
        with pytest.raises(openai.APIStatusError) as err:
            run_turns(openai_client(proxy), turns[:1])
        assert err.value.status_code == 401
    sid = new_id("keyed")
    with serve_proxy(keyed_server, POLICY, backend_api_key=BACKEND_KEY) as proxy:
        usage = run_turns(openai_client(proxy, **{SESSION_HEADER: sid}), turns[:5])
        detail = session_detail(proxy, sid)
        assert httpx.get(proxy + "/v1/models", timeout=30).status_code == 200
    plans = expected_plans(POLICY, turns[:5])
    assert detail["spliced_turns"] == 2 and detail["splice_misses"] == 0
    assert [c for _, c in usage][1:] == [p - len(plan.tail) for (p, _), plan in
                                          zip(usage[1:], plans[1:], strict=True)]  # fmt: skip


def test_replay_against_a_keyed_backend(
    keyed_server: str, turns: list[list[dict[str, Any]]], tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from leyline_agent.cli import app

    trace = tmp_path / "agent.jsonl"
    trace.write_text("\n".join(json.dumps({"messages": m, "tools": TOOLS}) for m in turns[:5]))
    args = ["replay", str(trace), "--backend", keyed_server, "--arms", "splice",
            "--out", str(tmp_path / "out"), "--no-agreement"]  # fmt: skip
    refused = CliRunner().invoke(app, args, env={"LEYLINE_BACKEND_API_KEY": ""})
    assert refused.exit_code != 0
    result = CliRunner().invoke(app, args, env={"LEYLINE_BACKEND_API_KEY": BACKEND_KEY})
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "out" / "results.json").read_text())
    text = json.dumps(rows)
    assert BACKEND_KEY not in text  # the key is never written out
    headline = json.loads(result.output.strip().splitlines()[-1])
    splice = headline["arms"]["splice"]
    assert splice["skipped_turns"] == 0 and splice["reused_tokens"] > 0


def test_debug_gym_harness_passes_the_key(
    keyed_server: str, turns: list[list[dict[str, Any]]]
) -> None:
    from leyline_agent.evals.debug_gym.backend import EvalError, ProxyServer, probe_backend

    with pytest.raises(EvalError, match="needs a key"):
        probe_backend(keyed_server + "/v1", None)
    with pytest.raises(EvalError, match="refuses the key"):
        probe_backend(keyed_server, None, "wrong")
    backend = probe_backend(keyed_server + "/v1", None, BACKEND_KEY)
    assert backend.leyline and backend.dummy and backend.model != "default"
    assert BACKEND_KEY not in json.dumps(backend.info) and BACKEND_KEY not in repr(backend)
    sid = new_id("dg")
    with ProxyServer(
        backend.url, POLICY, splice=True, model_path=None, backend_api_key=backend.api_key
    ) as proxy:
        run_turns(openai_client(proxy.url, **{SESSION_HEADER: sid}), turns[:5])
        detail = proxy.session(sid)
    assert detail is not None and detail["spliced_turns"] == 2 and detail["splice_misses"] == 0
