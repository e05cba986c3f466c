"""The OpenAI-compatible proxy, end to end on loopback.

A real ``leyline serve`` (the ``leyline_server`` fixture), the proxy (uvicorn in a thread, or the
``leyline proxy`` command in a subprocess) and the real ``openai`` client. The conversation is
teacher-forced: each turn sends the full message list built here, with ``max_tokens=1``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from leyline_agent.backends.sglang.launch import free_port, read_tail, wait_healthy
from leyline_agent.chat.openai import chat_request_view
from leyline_agent.client import LeylineClient
from leyline_agent.proxy import SESSION_HEADER, SessionRegistry, create_app, metrics
from leyline_agent.proxy.identity import SessionKey
from leyline_agent.session import SessionCore, TurnRecord
from leyline_agent.wrapper import ConversationWrapper, TurnPlan

POLICY = "stale_tool_outputs:keep_last=2"
SYSTEM = "You are a careful software engineer. Use the tools to inspect the repository."
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Print a file with line numbers.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "maxLength": 64}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite and print its output.",
            "parameters": {"type": "object", "properties": {"k": {"type": "string"}}},
        },
    },
]


def _call(step: int, n: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"call_{step}_{n}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


def _file(step: int, n: int) -> str:
    """A tool output of about 220 tokens."""
    return "\n".join(
        f"{i:4d}  def helper_{step}_{n}_{i}(value):  return value * {i} + {step} - {n}"
        for i in range(1, 16)
    )


def agent_conversation(steps: int = 5) -> list[list[dict[str, Any]]]:
    """Per turn, the full message list an agent sends: turn ``t`` holds ``t`` agent steps.

    Step 2 makes two parallel calls (two tool outputs); the others one.
    """
    history: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "The tests in tests/test_math.py fail. Find the bug."},
    ]
    turns = [list(history)]
    for step in range(1, steps + 1):
        calls = [_call(step, 0, "read_file", {"path": f"src/module_{step}.py"})]
        if step == 2:
            calls.append(_call(step, 1, "run_tests", {"k": "math"}))
        history.append({"role": "assistant", "content": f"Step {step}.", "tool_calls": calls})
        for n, c in enumerate(calls):
            history.append({"role": "tool", "tool_call_id": c["id"], "content": _file(step, n)})
        turns.append(list(history))
    return turns


def expected_plans(policy: str, turns: list[list[dict[str, Any]]]) -> list[TurnPlan]:
    """What the proxy's wrapper plans per turn (an independent wrapper with the same policy, on
    the request as SGLang's template sees it)."""
    wrapper = ConversationWrapper(policy=policy)
    plans = []
    for messages in turns:
        plan = wrapper.plan(*chat_request_view(messages, TOOLS))
        wrapper.commit(plan)
        plans.append(plan)
    return plans


@contextmanager
def serve_proxy(backend: str, policy: str, **kwargs: Any) -> Iterator[str]:
    """The proxy app served by uvicorn in a background thread; yields its base URL.

    NOTE: ``share_exact`` is off unless given: these tests replay one conversation in many
    sessions and assert each session's own cache figures; sharing exact KV across sessions is
    tested in ``test_sharing_live.py``."""
    kwargs.setdefault("share_exact", False)
    port = free_port()
    config = uvicorn.Config(
        create_app(backend, policy, **kwargs), host="127.0.0.1", port=port, log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the proxy did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


@contextmanager
def proxy_process(args: list[str]) -> Iterator[str]:
    """``leyline proxy ARGS`` in a subprocess; yields its base URL."""
    port = free_port()
    argv = [sys.executable, "-m", "leyline_agent.cli", "proxy", "--port", str(port), *args]
    log_path = Path(tempfile.mkstemp(prefix="leyline-proxy-", suffix=".log")[1])
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(
            url, proc, 60, name="leyline proxy", log_tail=lambda: read_tail(log_path), poll_s=0.2
        )
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def openai_client(proxy: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=proxy + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=120,
        default_headers=headers or None,
    )


def run_turns(
    client: openai.OpenAI, turns: list[list[dict[str, Any]]], **extra: Any
) -> list[tuple[int, int]]:
    """Send every turn; ``(prompt_tokens, cached_tokens)`` per turn."""
    out = []
    for messages in turns:
        r = client.chat.completions.create(
            model="default", messages=messages, tools=TOOLS, max_tokens=1, temperature=0, **extra
        )
        assert r.choices and r.choices[0].finish_reason is not None
        out.append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
    return out


def session_detail(proxy: str, session_id: str) -> dict[str, Any]:
    r = httpx.get(f"{proxy}/leyline/sessions/{session_id}", timeout=10)
    r.raise_for_status()
    return r.json()


def new_id(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


MEASURED: dict[str, list[dict[str, int]]] = {}  # arm -> per turn; printed by the summary test


def _measure(arm: str, usage: list[tuple[int, int]], plans: list[TurnPlan], detail: dict) -> None:
    MEASURED[arm] = [
        {
            "prompt": p,
            "cached": c,
            "tail": len(plan.tail),
            "prefilled": rec["prefilled_tokens"],
            "edited": rec["edited"],
        }
        for (p, c), plan, rec in zip(usage, plans, detail["records"], strict=True)
    ]


@pytest.fixture(scope="module", autouse=True)
def report_measured() -> Iterator[None]:
    """After the module: the per-turn figures of the three arms (shown with ``pytest -s``)."""
    yield
    for arm, rows in MEASURED.items():
        print(f"\n{arm:>9}: " + " ".join(f"{r['cached']}/{r['prompt']}" for r in rows))
    if MEASURED:
        print(json.dumps(MEASURED))


@pytest.fixture(scope="module")
def turns() -> list[list[dict[str, Any]]]:
    return agent_conversation()


@pytest.fixture(scope="module")
def splice_proxy(leyline_server: str) -> Iterator[str]:
    with serve_proxy(leyline_server, POLICY) as url:
        yield url


@pytest.mark.sglang
def test_splice_arm_caches_every_token_before_the_new_turn(
    splice_proxy: str, turns: list[list[dict[str, Any]]]
) -> None:
    sid = new_id("splice")
    usage = run_turns(openai_client(splice_proxy, **{SESSION_HEADER: sid}), turns)
    plans = expected_plans(POLICY, turns)
    detail = session_detail(splice_proxy, sid)
    _measure("splice", usage, plans, detail)
    records = detail["records"]
    assert [len(p.tokens) for p in plans] == [p for p, _ in usage]  # same rendering as the server
    assert [bool(p.directives) for p in plans] == [False] * 3 + [True] * 3
    for t, ((prompt, cached), plan, rec) in enumerate(zip(usage, plans, records, strict=True)):
        assert rec["prompt_tokens"] == prompt and rec["server_cached_tokens"] == cached
        if t >= 1:  # every turn after the first: all but the new tail is cached
            assert cached == prompt - len(plan.tail), (t, prompt, cached, len(plan.tail))
        if plan.directives:
            assert rec["spliced"] and rec["splice_error"] is None
            assert rec["directives_amortize"] == len(plan.directives)
            assert rec["splice_prefilled_tokens"] == sum(
                len(d.replacement) for d in plan.directives
            )
    assert detail["splice_misses"] == 0 and detail["turns"] == len(turns)


@pytest.mark.sglang
def test_session_isolation(splice_proxy: str, turns: list[list[dict[str, Any]]]) -> None:
    """B sends A's whole (already spliced) history: nothing of A's namespace is reused."""
    a, b = new_id("iso-a"), new_id("iso-b")
    run_turns(openai_client(splice_proxy, **{SESSION_HEADER: a}), turns[:4])
    assert session_detail(splice_proxy, a)["spliced_turns"] == 1
    [(prompt, cached)] = run_turns(openai_client(splice_proxy, **{SESSION_HEADER: b}), [turns[3]])
    assert prompt == len(expected_plans(POLICY, turns[:4])[-1].tokens)
    assert cached == 0, "session B hit session A's cache entries"
    da, db = session_detail(splice_proxy, a), session_detail(splice_proxy, b)
    assert da["namespace"] != db["namespace"]
    # A again, same history: its own entry is a full hit (but for the one token SGLang recomputes).
    [(prompt_a, cached_a)] = run_turns(
        openai_client(splice_proxy, **{SESSION_HEADER: a}), [turns[3]]
    )
    assert cached_a >= prompt_a - 1


@pytest.mark.sglang
def test_no_splice_arm_reprefills_edits(
    leyline_server: str, turns: list[list[dict[str, Any]]], tmp_path: Path
) -> None:
    """``leyline proxy --no-splice --record DIR`` (the CLI); sessions by the ``user`` field."""
    record = tmp_path / "record"
    args = ["--backend", leyline_server, "--policy", POLICY, "--no-splice", "--record", str(record)]
    with proxy_process(args) as proxy:
        usage = run_turns(openai_client(proxy), turns, user="agent-7")
        [summary] = httpx.get(proxy + "/leyline/sessions", timeout=10).json()["sessions"]
        assert summary["id"].startswith("user:agent-7:") and summary["user"] == "agent-7"
        detail = session_detail(proxy, summary["id"])
    plans = expected_plans(POLICY, turns)
    _measure("no-splice", usage, plans, detail)
    for t, ((prompt, cached), plan, rec) in enumerate(
        zip(usage, plans, detail["records"], strict=True)
    ):
        assert prompt == len(plan.tokens)
        assert not rec["spliced"] and rec["splice_error"] is None
        if plan.directives:  # re-prefilled from the first edit on
            first_edit = min(d.start for d in plan.directives)
            assert cached <= first_edit < prompt - len(plan.tail), (t, cached, first_edit)
        elif t >= 1:
            assert cached == prompt - len(plan.tail)
    assert detail["source"] == "user" and detail["turns"] == len(turns)

    from leyline_agent.traces import load

    [trace] = load(record)
    assert trace.turns == turns and trace.tools == TOOLS


@pytest.mark.sglang
def test_none_policy_keeps_the_whole_history(
    splice_proxy: str, leyline_server: str, turns: list[list[dict[str, Any]]]
) -> None:
    """Policy ``none``: no edit, so no re-prefill, but every tool output stays in the prompt.
    The session is found by its message prefix (no header, no ``user``)."""
    with serve_proxy(leyline_server, "none") as proxy:
        usage = run_turns(openai_client(proxy), turns)
        [summary] = httpx.get(proxy + "/leyline/sessions", timeout=10).json()["sessions"]
        detail = session_detail(proxy, summary["id"])
    plans = expected_plans("none", turns)
    _measure("none", usage, plans, detail)
    assert summary["source"] == "prefix" and summary["turns"] == len(turns)
    assert summary["edited_turns"] == 0
    for t, ((prompt, cached), plan) in enumerate(zip(usage, plans, strict=True)):
        assert prompt == len(plan.tokens)
        if t >= 1:
            assert cached == prompt - len(plan.tail)
    spliced = MEASURED.get("splice")
    if spliced:  # the policy's prompts are shorter once it edits
        assert all(
            s["prompt"] < n["prompt"]
            for s, n in zip(spliced[3:], MEASURED["none"][3:], strict=True)
        )


@pytest.mark.sglang
def test_streaming(splice_proxy: str, turns: list[list[dict[str, Any]]]) -> None:
    sid = new_id("stream")
    client = openai_client(splice_proxy, **{SESSION_HEADER: sid})
    plans = expected_plans(POLICY, turns[:3])
    run_turns(client, turns[:1])
    chunks = list(
        client.chat.completions.create(
            model="default", messages=turns[1], tools=TOOLS, max_tokens=2, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert any(c.choices for c in chunks)
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert usage.prompt_tokens == len(plans[1].tokens)
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - len(plans[1].tail)
    # Without include_usage the usage chunk is dropped, but the proxy still read it.
    chunks = list(
        client.chat.completions.create(
            model="default", messages=turns[2], tools=TOOLS, max_tokens=2, temperature=0,
            stream=True,
        )
    )  # fmt: skip
    assert chunks and all(c.usage is None for c in chunks) and any(c.choices for c in chunks)
    rec = session_detail(splice_proxy, sid)["records"][2]
    assert rec["prompt_tokens"] == len(plans[2].tokens)
    assert rec["server_cached_tokens"] == rec["prompt_tokens"] - len(plans[2].tail)
    assert rec["ttft_ms"] is not None


@pytest.mark.sglang
def test_tools_reach_the_backend(splice_proxy: str, turns: list[list[dict[str, Any]]]) -> None:
    client = openai_client(splice_proxy)
    r = client.chat.completions.create(
        model="default", messages=turns[0], tools=TOOLS, tool_choice="auto", max_tokens=4
    )
    with_tools = ConversationWrapper().plan(*chat_request_view(turns[0], TOOLS))
    without = ConversationWrapper().plan(turns[0])
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(with_tools.tokens) > len(without.tokens)
    models = client.models.list()
    assert models.data and models.data[0].id


@pytest.mark.sglang
def test_every_other_route_is_forwarded_to_the_backend(
    leyline_server: str, splice_proxy: str
) -> None:
    """``GET /v1/models/{id}``, ``POST /v1/completions`` (in the tenant's shared namespace: a
    repeated prompt is a hit) and a route the proxy does not know answer as the backend does,
    through the real ``openai`` client (before: the proxy's bare 404 on all three)."""
    client = openai_client(splice_proxy)
    served = client.models.list().data[0].id
    assert client.models.retrieve(served).id == served
    prompt = f"{SYSTEM} Forwarded completions {uuid.uuid4().hex}."
    first = client.completions.create(model=served, prompt=prompt, max_tokens=1, temperature=0)
    again = client.completions.create(model=served, prompt=prompt, max_tokens=1, temperature=0)
    assert first.usage is not None and again.usage is not None
    assert first.usage.prompt_tokens == again.usage.prompt_tokens > 10
    details = again.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == again.usage.prompt_tokens - 1
    # the same prompt in the backend's default namespace is not the proxy's entry: a cold prefill
    direct = httpx.post(leyline_server + "/v1/completions", timeout=60,
                        json={"model": served, "prompt": prompt, "max_tokens": 1})  # fmt: skip
    assert direct.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for path in ("/v1/no-such-route", "/v1/models/no-such-model"):
        mine, theirs = httpx.get(splice_proxy + path), httpx.get(leyline_server + path)
        assert (mine.status_code, mine.content) == (theirs.status_code, theirs.content), path
    text = httpx.get(splice_proxy + "/metrics").text
    completions = [line for line in text.splitlines()
                   if line.startswith('leyline_proxy_route_requests_total{route="/v1/completions"}')]  # fmt: skip
    assert len(completions) == 1 and int(completions[0].split()[-1]) >= 2


@pytest.mark.sglang
def test_fallback_after_the_backend_lost_the_entry(
    splice_proxy: str, leyline_server: str, turns: list[list[dict[str, Any]]]
) -> None:
    """The backend's cache is flushed before an edited turn: the splice fails, the request still
    answers, the turn is a miss; the next edited turn splices again."""
    sid = new_id("fallback")
    client = openai_client(splice_proxy, **{SESSION_HEADER: sid})
    plans = expected_plans(POLICY, turns)
    run_turns(client, turns[:3])
    httpx.post(leyline_server + "/flush_cache", timeout=30).raise_for_status()
    [(prompt, _)] = run_turns(client, [turns[3]])
    [(prompt5, cached5)] = run_turns(client, [turns[4]])
    detail = session_detail(splice_proxy, sid)
    miss, after = detail["records"][3], detail["records"][4]
    assert prompt == len(plans[3].tokens)
    assert miss["edited"] and not miss["spliced"] and miss["splice_error"]
    assert after["spliced"] and after["splice_error"] is None
    assert cached5 == prompt5 - len(plans[4].tail)
    assert detail["splice_misses"] == 1
    metrics = httpx.get(splice_proxy + "/metrics", timeout=10).text
    assert f'leyline_proxy_session_splice_misses_total{{session="{sid}"}} 1' in metrics
    assert "leyline_proxy_splice_misses_total " in metrics


def test_backend_down_is_a_quick_502() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with serve_proxy(dead, POLICY, connect_timeout=2.0) as proxy:
        client = openai_client(proxy)
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=1
            )
        assert err.value.status_code == 502
        assert "unreachable" in err.value.message
        r = httpx.get(proxy + "/v1/models", timeout=10)
        assert r.status_code == 502
        assert time.monotonic() - t0 < 10


def test_bad_request_is_a_400() -> None:
    with serve_proxy(f"http://127.0.0.1:{free_port()}", "none") as proxy:
        r = httpx.post(proxy + "/v1/chat/completions", json={"model": "m"}, timeout=10)
        assert r.status_code == 400 and "messages" in r.json()["message"]  # the backend's format


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


def test_registry_resolution_order() -> None:
    reg = SessionRegistry(_core)
    m = agent_conversation()[-1]
    by_header = reg.resolve(m, header="h1", user="u")
    assert (by_header.id, by_header.source) == ("h1", "header")
    assert reg.resolve(m, header="h1") is by_header
    by_user = reg.resolve(m, user="u")  # a user is a scope: its conversation gets an id
    assert by_user.id.startswith("user:u:") and by_user.source == "user"
    by_header.core.messages = m[:4]  # named sessions are never matched by prefix
    short, long_ = reg.resolve(m[:2]), reg.resolve(m[:3])
    assert short is not long_ and short.source == long_.source == "new"
    short.core.messages, long_.core.messages = m[:2], m[:5]
    assert reg.resolve(m) is long_ and long_.source == "prefix"
    assert reg.resolve(m[:4]) is short  # m[:5] is no prefix of m[:4]
    # a session that already reached this length never takes it (another run of the agent)
    assert reg.resolve(m[:5]) is short
    other = [{"role": "user", "content": "something else"}]
    assert reg.resolve(other) not in (short, long_, by_header)


def test_registry_drops_the_least_recently_used_and_keeps_its_counters() -> None:
    reg = SessionRegistry(_core, max_sessions=2)
    a = reg.resolve([], header="a")
    a.core.records.append(TurnRecord(turn=0, prompt_tokens=10, server_cached_tokens=4,
                                     prefilled_tokens=6, reused_tokens=4,
                                     best_reused_tokens=4))  # fmt: skip
    reg.resolve([], header="b")
    reg.resolve([], header="c")
    assert reg.get("a") is None and {s.id for s in reg.sessions()} == {"b", "c"}
    assert reg.totals().prompt_tokens == 10 and reg.created == 3


def test_metrics_text_parses() -> None:
    parser = pytest.importorskip("prometheus_client.parser")
    reg = SessionRegistry(_core)
    s = reg.resolve([], header='odd"id')
    assert s.id == "odd%22id"  # header names are percent-escaped in public ids
    s.core.records.append(
        TurnRecord(turn=0, prompt_tokens=100, server_cached_tokens=90, prefilled_tokens=10,
                   reused_tokens=90, best_reused_tokens=90, directives_amortize=2, edited=True,
                   splice_error="409: not cached", splice_ms=3.5, request_ms=20.0)
    )  # fmt: skip
    text = metrics.render(reg)
    samples = {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for family in parser.text_string_to_metric_families(text)
        for x in family.samples
    }
    assert samples[("leyline_proxy_prompt_tokens_total", ())] == 100
    assert samples[("leyline_proxy_splice_misses_total", ())] == 1
    assert samples[("leyline_proxy_directives_total", (("mode", "amortize"),))] == 2
    assert samples[("leyline_proxy_request_seconds_sum", ())] == pytest.approx(0.02)
    key = ("leyline_proxy_session_cached_tokens_total", (("session", "odd%22id"),))
    assert samples[key] == 90
