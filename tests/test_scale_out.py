"""The proxy over two real servers (issue 17, several servers): sessions spread by rendezvous
hashing, one server killed mid-run, every turn answered, the failover counted.

Two ``leyline serve`` (8192-token pools, debug endpoints), ``leyline proxy`` with both as
``--backend`` in process on loopback, the real ``openai`` client without retries (a 5xx would
fail the test, not be retried away). The health interval is long, so the failover under test is
the one a refused connection triggers inside a turn (the proxy plans the turn again on the
session's next backend).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

import httpx
import openai
import pytest
from live import assert_integrity, stats
from requires import require_sglang
from test_proxy import serve_proxy

from leyline_agent.backends.sglang.launch import EmbeddedServer
from leyline_agent.proxy.identity import SessionKey
from leyline_agent.routing import home
from leyline_agent.testing.soak import TOOLS, turn_messages

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolUnionParam

pytestmark = [pytest.mark.sglang, pytest.mark.live]

POLICY = "stale_tool_outputs:keep_last=2"  # edits from the fourth turn on
TURNS, PER_BACKEND = 5, 3


@pytest.fixture(scope="module")
def servers() -> Iterator[list[EmbeddedServer]]:
    require_sglang()
    env = {"LEYLINE_DEBUG_ENDPOINTS": "1"}
    pair = [EmbeddedServer(max_total_tokens=8192, env=env) for _ in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:  # start both at once: half the wait
            list(pool.map(lambda s: s.start(), pair))
        yield pair
    finally:
        for s in pair:
            s.stop()


def names(urls: list[str]) -> dict[str, str]:
    """Session name -> home backend: the first names giving each backend ``PER_BACKEND``."""
    out: dict[str, str] = {}
    i = 0
    while len(out) < PER_BACKEND * len(urls):
        name = f"scale-{i}"
        url = home(urls, SessionKey("default", "header", name).namespace)
        if sum(u == url for u in out.values()) < PER_BACKEND:
            out[name] = url
        i += 1
    return out


def turn(proxy: str, name: str, messages: list[dict[str, Any]]) -> None:
    client = openai.OpenAI(
        base_url=proxy + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=600,
        default_headers={"X-Leyline-Session": name},
    )
    r = client.chat.completions.create(
        model="default",
        messages=cast("list[ChatCompletionMessageParam]", messages),
        tools=cast("list[ChatCompletionToolUnionParam]", TOOLS),
        max_tokens=2,
        temperature=0,
    )
    assert r.choices and r.usage is not None


def metric(text: str, name: str, labels: str) -> float:
    prefix = f"{name}{{{labels}}} "
    line = next(ln for ln in text.splitlines() if ln.startswith(prefix))
    return float(line[len(prefix) :])


def test_sessions_spread_and_fail_over(servers: list[EmbeddedServer]) -> None:
    a, b = servers
    urls = [a.url, b.url]
    sessions = names(urls)
    history = {n: turn_messages(90 + i, TURNS, 6) for i, n in enumerate(sessions)}
    # NOTE: serve_proxy passes the backend to create_app, which takes a list of URLs too
    with serve_proxy(cast(str, urls), POLICY, health_interval=3600.0) as proxy:

        def run_turn(t: int) -> None:  # turn t of every session, all at once
            with ThreadPoolExecutor(len(sessions)) as pool:
                list(pool.map(lambda n: turn(proxy, n, history[n][t]), sessions))

        for t in range(3):
            run_turn(t)
        listing = httpx.get(f"{proxy}/leyline/sessions", timeout=30).json()
        assert {s["id"]: s["backend"] for s in listing["sessions"]} == sessions
        text = httpx.get(f"{proxy}/metrics", timeout=30).text
        for url in urls:
            labels = f'backend="{url}"'
            assert metric(text, "leyline_proxy_backend_sessions", labels) == PER_BACKEND
            assert metric(text, "leyline_proxy_backend_requests_total", labels) == 3 * PER_BACKEND
            assert metric(text, "leyline_proxy_backend_up", labels) == 1

        b.stop()  # mid-run: its sessions' next turns must land on a
        for t in range(3, TURNS):
            run_turn(t)  # no retries in the client: any 5xx or refused turn raises

        listing = httpx.get(f"{proxy}/leyline/sessions", timeout=30).json()
        assert all(s["backend"] == a.url for s in listing["sessions"])
        for name, url in sessions.items():
            records = httpx.get(f"{proxy}/leyline/sessions/{name}", timeout=30).json()["records"]
            assert len(records) == TURNS
            fourth, fifth = records[3], records[4]
            assert fourth["edited"] and fifth["edited"] and fifth["spliced"], records
            if url == b.url:  # failed over: a cold prefill counted as a miss, then splices
                assert not fourth["spliced"] and fourth["splice_miss_reason"] == "failover"
                assert fourth["best_reused_tokens"] == 0
                assert fourth["server_cached_tokens"] < fourth["prompt_tokens"] // 2
            else:
                assert fourth["spliced"] and fourth["splice_error"] is None
        totals = listing["totals"]
        assert totals["splice_misses"] == PER_BACKEND
        assert totals["misses_by_reason"] == {"failover": PER_BACKEND}
        text = httpx.get(f"{proxy}/metrics", timeout=30).text
        assert 'leyline_proxy_splice_misses_by_reason_total{reason="failover"} 3' in text
        assert metric(text, "leyline_proxy_backend_up", f'backend="{b.url}"') == 0
        assert metric(text, "leyline_proxy_backend_failovers_total", f'backend="{b.url}"') == 3
        assert metric(text, "leyline_proxy_backend_errors_total", f'backend="{b.url}"') >= 1
        assert metric(text, "leyline_proxy_backend_sessions", f'backend="{a.url}"') == 6
    with httpx.Client(base_url=a.url, timeout=60) as c:
        assert_integrity(stats(c))
