"""The proxy under real traffic (issue 11): concurrent sessions with a pool smaller than their
working set, a client that disconnects mid-stream, a backend restarted between turns. A real
``leyline serve`` (2048-token pool, debug endpoints), the proxy on loopback, the real ``openai``
client and raw httpx streaming."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from live import assert_integrity, stats
from requires import require_sglang
from test_proxy import serve_proxy

from leyline_agent.backends.sglang.launch import EmbeddedServer
from leyline_agent.testing.soak import TOOLS, run_soak, turn_messages

pytestmark = [pytest.mark.sglang, pytest.mark.live]

POLICY = "stale_tool_outputs:keep_last=2"


@pytest.fixture(scope="module")
def backend() -> Iterator[EmbeddedServer]:
    require_sglang()
    with EmbeddedServer(max_total_tokens=2048, env={"LEYLINE_DEBUG_ENDPOINTS": "1"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def proxy(backend: EmbeddedServer) -> Iterator[str]:
    with serve_proxy(backend.url, POLICY) as url:
        yield url


def chat(proxy: str, sid: str, messages: list[dict[str, Any]], **kw: Any) -> httpx.Response:
    body = {"model": "default", "messages": messages, "tools": TOOLS, "max_tokens": 2, **kw}
    return httpx.post(
        f"{proxy}/v1/chat/completions",
        json=body,
        headers={"X-Leyline-Session": sid},
        timeout=600,
    )


def records(proxy: str, sid: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{proxy}/leyline/sessions/{sid}", timeout=30)
    r.raise_for_status()
    return r.json()["records"]


def test_concurrent_sessions_in_a_small_pool(proxy: str, backend: EmbeddedServer) -> None:
    fig = run_soak(proxy, sessions=4, turns=6, lines=6)
    assert fig["turns"] == 24 and fig["errors_5xx"] == 0 and not fig["errors"], fig
    assert fig["edited_turns"] == 4 * 3  # turns 4-6 of each session edit a stale output
    # every edited turn spliced, or fell back with a named reason
    assert fig["spliced_turns"] + fig["splice_misses"] == fig["edited_turns"], fig
    assert sum(fig["misses_by_reason"].values()) == fig["splice_misses"], fig
    assert fig["spliced_turns"] > 0, fig
    with httpx.Client(base_url=backend.url, timeout=60) as c:
        assert_integrity(stats(c))


def test_client_disconnect_mid_stream_leaves_no_lock_or_leak(
    proxy: str, backend: EmbeddedServer
) -> None:
    turns = turn_messages(90, 5, 6)
    for messages in turns[:4]:
        assert chat(proxy, "disc", messages).status_code == 200
    body = {
        "model": "default",
        "messages": turns[4],
        "tools": TOOLS,
        "max_tokens": 64,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        f"{proxy}/v1/chat/completions",
        json={**body, "ignore_eos": True},
        headers={"X-Leyline-Session": "disc"},
        timeout=600,
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # close the connection after the first data line
    with httpx.Client(base_url=backend.url, timeout=60) as c:
        deadline = time.monotonic() + 60
        st = stats(c)
        while not st["ok"] and time.monotonic() < deadline:
            time.sleep(0.5)
            st = stats(c)
        assert_integrity(st)
    # the proxy's session lock was released: the next turn goes through
    assert chat(proxy, "disc", turns[4]).status_code == 200


def test_backend_restart_between_turns(proxy: str, backend: EmbeddedServer) -> None:
    turns = turn_messages(91, 7, 6)
    for messages in turns[:4]:
        assert chat(proxy, "restart", messages).status_code == 200
    assert records(proxy, "restart")[-1]["spliced"] is True
    backend.stop()
    down = chat(proxy, "restart", turns[4])
    assert down.status_code == 502 and "unreachable" in down.json()["error"]["message"]
    backend.start()  # same port, empty cache
    r = chat(proxy, "restart", turns[4])
    assert r.status_code == 200, r.text
    rec = records(proxy, "restart")[-1]
    assert rec["edited"] and not rec["spliced"]
    assert rec["splice_miss_reason"] == "not_cached"
    assert rec["server_cached_tokens"] < rec["prompt_tokens"] // 2  # a cold, full prefill
    r = chat(proxy, "restart", turns[5])
    assert r.status_code == 200
    rec = records(proxy, "restart")[-1]
    assert rec["spliced"] is True, rec
    metrics = httpx.get(f"{proxy}/metrics", timeout=30).text
    assert 'leyline_proxy_splice_misses_by_reason_total{reason="not_cached"}' in metrics
    with httpx.Client(base_url=backend.url, timeout=60) as c:
        assert_integrity(stats(c))
