"""Scale-out on the SGLang gateway (issue 28): two ``leyline serve`` workers behind ``smg
--policy consistent_hashing``, the proxy in front of the gateway (found out as one: ``/leyline/*``
answers the gateway's 404), the real ``openai`` client without retries.

Every request carries its session's routing key and every edit rides in-band on its request, so
each session's turns and splices reach the worker that holds its KV. One module-scoped fixture
(two workers and the gateway, ~2-3 min on 2 cores); the tests run in file order: the replay first,
the worker kill last.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

import httpx
import openai
import pytest
from gateway import gateway, routed, served, worker_id, workers
from live import assert_integrity, stats
from requires import require_sglang
from test_proxy import serve_proxy

from leyline_agent.backends.sglang.launch import EmbeddedServer
from leyline_agent.client import LeylineClient
from leyline_agent.proxy.identity import SessionKey
from leyline_agent.replay.runner import replay
from leyline_agent.replay.spec import ReplaySpec
from leyline_agent.testing.soak import TOOLS, turn_messages

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolUnionParam

pytestmark = [pytest.mark.sglang, pytest.mark.live]

POLICY = "stale_tool_outputs:keep_last=2"  # edits from the fourth turn (index 3) on
TURNS, SESSIONS, KILL_AFTER = 6, 6, 4  # turns 0-3 on both workers, 4-5 after one is killed


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[list[EmbeddedServer], str]]:
    require_sglang()
    with workers(2) as pair, gateway([s.url for s in pair]) as url:
        yield pair, url


def chat(proxy: str, name: str, messages: list[dict[str, Any]], model: str) -> None:
    client = openai.OpenAI(
        base_url=proxy + "/v1", api_key="unused", max_retries=0, timeout=600,
        default_headers={"X-Leyline-Session": name},
    )  # fmt: skip
    r = client.chat.completions.create(
        model=model,
        messages=cast("list[ChatCompletionMessageParam]", messages),
        tools=cast("list[ChatCompletionToolUnionParam]", TOOLS),
        max_tokens=2,
        temperature=0,
    )
    assert r.choices and r.usage is not None


def test_gateway_is_found_out_and_refuses_leyline_routes(
    fleet: tuple[list[EmbeddedServer], str],
) -> None:
    (a, _), url = fleet
    assert LeylineClient(url).gateway and not LeylineClient(a.url).gateway
    assert httpx.post(f"{url}/leyline/splice", json={}, timeout=30).status_code == 404


def test_replay_over_the_gateway_equals_one_server(
    fleet: tuple[list[EmbeddedServer], str],
) -> None:
    (a, _), url = fleet
    from leyline_agent.chat.model_dir import load_renderer
    from leyline_agent.replay import examples_dir
    from leyline_agent.traces import load

    traces = list(load(examples_dir()))[:2]
    spec = ReplaySpec(traces=[], policy=POLICY, concurrency=[2], max_turns=6, agreement=False)
    renderer = load_renderer(None)
    by_arm: dict[str, dict[str, tuple[int, int, int]]] = {}
    for where, client in [("gateway", LeylineClient(url)), ("one", LeylineClient(a.url))]:
        rows = [row for level in replay(spec, client, renderer, traces) for row in level.rows]
        for arm in spec.arms:
            mine = [r for r in rows if r.arm == arm]
            cached = sum(r.server_cached_tokens for r in mine)
            prompt = sum(r.prompt_tokens for r in mine)
            misses = sum(1 for r in mine if r.splice_error is not None)
            by_arm.setdefault(arm, {})[where] = (cached, prompt, misses)
    for arm, got in by_arm.items():
        assert got["gateway"] == got["one"], (arm, got)
        assert got["gateway"][2] == 0
    assert by_arm["splice"]["one"][0] > by_arm["reprefill"]["one"][0]  # the splices did reuse


def test_sessions_spread_splice_in_band_and_move_on_a_kill(
    fleet: tuple[list[EmbeddedServer], str],
) -> None:
    (a, b), url = fleet
    ids = {worker_id(a.url): a, worker_id(b.url): b}
    names = [f"gw-{i}" for i in range(SESSIONS)]
    home = {n: ids[routed(url, SessionKey("default", "header", n).namespace)] for n in names}
    assert {s.url for s in home.values()} == {a.url, b.url}  # both workers hold sessions
    history = {n: turn_messages(200 + i, TURNS, 6) for i, n in enumerate(names)}
    with serve_proxy(url, POLICY, share_exact=True) as proxy:
        model = served(proxy)

        def run_turn(t: int) -> None:  # turn t of every session, all at once
            with ThreadPoolExecutor(len(names)) as pool:
                list(pool.map(lambda n: chat(proxy, n, history[n][t], model), names))

        def records(name: str) -> list[dict[str, Any]]:
            r = httpx.get(f"{proxy}/leyline/sessions/{name}", timeout=30)
            return cast("list[dict[str, Any]]", r.json()["records"])

        for t in range(KILL_AFTER):
            run_turn(t)
        for n in names:
            edited = [r for r in records(n) if r["edited"]]
            assert edited and all(r["spliced"] for r in edited), records(n)
        totals = httpx.get(f"{proxy}/leyline/sessions", timeout=30).json()["totals"]
        assert totals["splice_misses"] == 0
        for s in (a, b):
            with httpx.Client(base_url=s.url, timeout=60) as c:
                assert stats(c)["ok"]

        b.stop()  # its sessions' next turns reach a through the gateway
        for t in range(KILL_AFTER, TURNS):
            run_turn(t)  # no retries in the client: any 4xx/5xx raises
        moved = [n for n in names if home[n] is b]
        for n in names:
            rec = records(n)
            assert len(rec) == TURNS
            first, second = rec[KILL_AFTER], rec[KILL_AFTER + 1]
            assert first["edited"] and second["edited"] and second["spliced"], rec
            if n in moved:  # a cold prefill on a, counted as a miss; then splices there
                assert not first["spliced"] and first["splice_miss_reason"] == "failover"
                assert first["server_cached_tokens"] < first["prompt_tokens"] // 2
            else:
                assert first["spliced"] and first["splice_error"] is None
        totals = httpx.get(f"{proxy}/leyline/sessions", timeout=30).json()["totals"]
        assert totals["splice_misses"] == len(moved)
        assert totals["misses_by_reason"] == {"failover": len(moved)}
    with httpx.Client(base_url=a.url, timeout=60) as c:
        assert_integrity(stats(c))
