"""The proxy's backend pool without servers: routing, failover, health polls, /metrics."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import httpx
import pytest

from leyline_agent.proxy import metrics
from leyline_agent.proxy.backends import BackendPool
from leyline_agent.proxy.sessions import ProxySession
from leyline_agent.routing import rank

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]


class FakePlacement:
    def __init__(self, namespace: str) -> None:
        self.own = namespace
        self.client: Any = None

    def bind(self, client: Any) -> None:
        self.client = client


class FakeCore:
    def __init__(self, namespace: str) -> None:
        self.placement = FakePlacement(namespace)
        self.moves: list[str] = []

    def move(self, client: Any, why: str) -> None:
        self.placement.client = client
        self.moves.append(why)


class FakeSession:
    def __init__(self, name: str) -> None:
        self.id = name
        self.core = FakeCore(f"leyline:default:header:{name}")
        self.backend: str | None = None


def pool(**kw: Any) -> BackendPool:
    return BackendPool(URLS, timeout=httpx.Timeout(1.0), **kw)


def route(p: BackendPool, s: FakeSession) -> str:
    return p.route(cast(ProxySession, s)).url


def test_new_sessions_go_home_and_stay() -> None:
    p = pool()
    sessions = [FakeSession(f"s{i}") for i in range(30)]
    for s in sessions:
        assert route(p, s) == rank(URLS, s.core.placement.own)[0] == s.backend
        assert s.core.placement.client is p.backends[s.backend].client and not s.core.moves
    assert {s.backend for s in sessions} == set(URLS)  # spread over all three


def test_failover_moves_only_the_down_backends_sessions_and_never_back() -> None:
    p = pool()
    sessions = [FakeSession(f"s{i}") for i in range(30)]
    before = {s.id: route(p, s) for s in sessions}
    down = p.backends[URLS[0]]
    p.mark_down(down, "ConnectError('refused')")
    for s in sessions:
        order = rank(URLS, s.core.placement.own)
        if before[s.id] == URLS[0]:
            assert route(p, s) == order[1] and len(s.core.moves) == 1
            assert "ConnectError" in s.core.moves[0]
        else:
            assert route(p, s) == before[s.id] and not s.core.moves
    assert down.failovers == sum(b == URLS[0] for b in before.values())
    down.up = True  # back: moved sessions stay where their KV now is; new ones go home
    for s in sessions:
        if before[s.id] == URLS[0]:
            assert route(p, s) != URLS[0] and len(s.core.moves) == 1
    fresh = FakeSession("fresh")
    assert route(p, fresh) == rank(URLS, fresh.core.placement.own)[0]


def test_every_backend_down_keeps_the_session_where_it_is() -> None:
    p = pool()
    s = FakeSession("x")
    home = route(p, s)
    for b in p.backends.values():
        p.mark_down(b, "refused")
    assert route(p, s) == home and not s.core.moves
    assert p.up() == []


def test_health_polls_mark_down_after_two_failures_and_up_after_one_answer() -> None:
    answers = {"status": 500}

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/health"
        return httpx.Response(answers["status"])

    p = pool()
    b = p.first
    b.http = httpx.AsyncClient(base_url=b.url, transport=httpx.MockTransport(handler))
    assert asyncio.run(p.poll(b)) is False and b.up  # one failed poll is not enough
    assert asyncio.run(p.poll(b)) is False and not b.up
    answers["status"] = 200
    assert asyncio.run(p.poll(b)) is True and b.up


def test_a_refused_connection_marks_down_at_once() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    p = pool()
    b = p.first
    b.http = httpx.AsyncClient(base_url=b.url, transport=httpx.MockTransport(handler))
    assert asyncio.run(p.poll(b)) is False and not b.up


def test_metrics_per_backend() -> None:
    p = pool()
    sessions = [FakeSession(f"s{i}") for i in range(6)]
    for s in sessions:
        route(p, s)
    p.first.count()
    p.first.count(error=True)
    p.mark_down(p.backends[URLS[1]], "refused")
    text = metrics.render_backends(p, cast(list[ProxySession], sessions))
    assert f'leyline_proxy_backend_requests_total{{backend="{URLS[0]}"}} 2' in text
    assert f'leyline_proxy_backend_errors_total{{backend="{URLS[0]}"}} 1' in text
    assert f'leyline_proxy_backend_up{{backend="{URLS[1]}"}} 0' in text
    assert f'leyline_proxy_backend_up{{backend="{URLS[2]}"}} 1' in text
    on = sum(s.backend == URLS[2] for s in sessions)
    assert f'leyline_proxy_backend_sessions{{backend="{URLS[2]}"}} {on}' in text


def test_bad_backend_lists() -> None:
    with pytest.raises(ValueError, match="twice"):
        BackendPool([URLS[0], URLS[0] + "/"], timeout=httpx.Timeout(1.0))
    with pytest.raises(ValueError, match="no backend"):
        BackendPool([], timeout=httpx.Timeout(1.0))
