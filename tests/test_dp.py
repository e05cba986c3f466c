"""DP inside one server (``--dp-size``): pinning a namespace to a rank, picking a worker's reply,
merging stats (``backends/sglang/dp.py``; pure, no server), and live against its own
``leyline serve --dp-size 2`` (8192-token pool per rank; ``-m 'not live'`` skips it)."""

from __future__ import annotations

import collections
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from live import gen, seq
from requires import require_sglang

from leyline_agent import inband
from leyline_agent.backends.sglang.dp import (
    NOT_MINE,
    Reply,
    home_rank,
    merge_stats,
    namespace_key,
    pick_reply,
    pin_prefix,
    rank_of_pin,
)
from leyline_agent.backends.sglang.launch import EmbeddedServer, cpu_rank_count, cpu_threads_bind


def test_home_rank_unpinned_without_namespace_or_dp():
    assert home_rank(None, None, 4) is None
    assert home_rank(None, "", 4) is None
    assert home_rank("leyline:a", None, 1) is None
    assert home_rank("leyline:a", None, 0) is None


def test_home_rank_stable_in_range_and_spread():
    keys = [f"leyline:s{i}" for i in range(400)]
    ranks = [home_rank(k, None, 2) for k in keys]
    assert ranks == [home_rank(k, None, 2) for k in keys]
    assert set(ranks) == {0, 1}
    counts = collections.Counter(home_rank(k, None, 4) for k in keys)
    assert set(counts) == {0, 1, 2, 3}
    assert min(counts.values()) > 60  # about 100 each


def test_namespace_components_both_count():
    assert namespace_key("a", None) != namespace_key("a", "salt")
    assert namespace_key(None, "s") == "\0s"
    # rendezvous: growing the pool moves only the keys the new rank wins
    keys = [f"k{i}" for i in range(300)]
    moved = [k for k in keys if home_rank(k, None, 2) != home_rank(k, None, 3)]
    assert all(home_rank(k, None, 3) == 2 for k in moved)


def test_pick_reply_target_rank():
    replies = [Reply(0, NOT_MINE, "{}"), Reply(1, 200, '{"in_place": true}')]
    assert pick_reply(replies, 1).dp_rank == 1
    replies = [Reply(0, 409, "{}"), Reply(1, NOT_MINE, "{}")]
    assert pick_reply(replies, 0).status == 409  # the target's own 409, not another's 200
    with pytest.raises(ValueError):
        pick_reply([Reply(0, 200, "{}")], 1)
    with pytest.raises(ValueError):
        pick_reply([], None)


def test_pick_reply_aggregate_rule():
    # the rank that held the sequence answers, whatever its position
    assert pick_reply([Reply(0, 409, "a"), Reply(1, 200, "b")], None).body == "b"
    assert pick_reply([Reply(1, 200, "b"), Reply(0, 409, "a")], None).body == "b"
    # nobody held it: one 409 (lowest rank)
    assert pick_reply([Reply(1, 409, "b"), Reply(0, 409, "a")], None).body == "a"
    # several held it: an error on any rank wins (that rank's cache misses the edit) ...
    assert pick_reply([Reply(0, 200, "a"), Reply(1, 500, "b")], None).status == 500
    # ... else the lowest rank's success
    assert pick_reply([Reply(1, 200, "b"), Reply(0, 200, "a")], None).body == "a"
    # a single worker (no DP) is answered as before
    assert pick_reply([Reply(0, 422, "x")], None).status == 422


def test_pin_ids_name_their_rank():
    for rank in (0, 1, 12):
        assert rank_of_pin(f"{pin_prefix(rank)}-0123abcd") == rank
    assert rank_of_pin("p-0123abcd") is None  # the default prefix (no DP rank)
    assert rank_of_pin("unknown") is None and rank_of_pin("") is None


def test_merge_stats():
    w0 = {"free": 10, "cached": 5, "in_use": 0, "total": 15, "evictable": 5, "protected": 0,
          "duplicate_slots": 0, "tree_and_free_list": 0, "idle": True,
          "sglang_idle_check": True, "ok": True}  # fmt: skip
    assert merge_stats([w0]) == w0
    w1 = {**w0, "free": 12, "cached": 3, "ok": None, "idle": False}
    m = merge_stats([w0, w1])
    assert (m["free"], m["cached"], m["total"]) == (22, 8, 30)
    assert m["idle"] is False and m["sglang_idle_check"] is True
    assert m["ok"] is None
    assert m["dp_size"] == 2 and m["dp_workers"] == [w0, w1]
    assert merge_stats([w0, {**w1, "ok": False}])["ok"] is False
    assert merge_stats([w0, w0])["ok"] is True
    one = merge_stats([{**w0, "busy": []}, {**w1, "busy": ["running_batch", "chunked_req"]}])
    assert one["busy"] == ["chunked_req", "running_batch"]  # any rank's busy state, once


def test_cpu_rank_count_and_threads_bind():
    assert cpu_rank_count([]) == 1
    assert cpu_rank_count(["--dp-size", "2"]) == 2
    assert cpu_rank_count(["--tp-size=2", "--dp", "2", "--pp-size", "1"]) == 4
    assert cpu_rank_count(["--tp-size", "2", "--tp-size", "1"]) == 1  # the last one wins
    groups = cpu_threads_bind(2).split("|")
    assert len(groups) == 2 and all(groups)
    assert len(cpu_threads_bind(64).split("|")) == 64  # more ranks than cores: shared cores


# ---- live: one server with --dp-size 2 ---------------------------------------------------------

DIRECTIVES = [{"start": 20, "end": 30, "replacement": [11, 12, 13]}]


def edited(base: list[int]) -> list[int]:
    return base[:20] + [11, 12, 13] + base[30:]


def namespace_on(rank: int, tag: str) -> str:
    return next(k for i in range(1000) if home_rank(k := f"dp-{tag}-{i}", None, 2) == rank)


@pytest.fixture(scope="module")
def dp_server() -> Iterator[str]:
    require_sglang()
    srv = EmbeddedServer(
        max_total_tokens=8192, extra_args=["--dp-size", "2"], env={"LEYLINE_DEBUG_ENDPOINTS": "1"}
    )
    with srv:
        yield srv.url


def splice(c: httpx.Client, tokens: list[int], key: str, **extra: Any) -> httpx.Response:
    return c.post(
        "/leyline/splice",
        json={"tokens": tokens, "directives": DIRECTIVES, "extra_key": key, **extra},
    )


@pytest.mark.sglang
@pytest.mark.live
def test_dp2_sessions_on_both_ranks_splice(dp_server: str) -> None:
    c = httpx.Client(base_url=dp_server, timeout=600)
    base = seq(120, seed=7)
    keys = {r: namespace_on(r, "s") for r in (0, 1)}
    for rank, key in keys.items():
        assert gen(c, base, key)["cached_tokens"] == 0  # pinned to `rank` by the server
        r = splice(c, base, key)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["in_place"] is True and body["dp_rank"] == rank
        assert body["cached_before"] == len(base) and body["new_length"] == len(edited(base))
        meta = gen(c, edited(base) + [500, 501], key, max_new_tokens=4)
        assert meta["cached_tokens"] == len(edited(base))  # the next request is fully cached
    # greedy equality with a fresh prefill of the edited prompt
    ref = namespace_on(1, "ref")
    outs = []
    for key in (keys[0], keys[1], ref):
        r = c.post(
            "/generate",
            json={
                "input_ids": edited(base) + [500, 501],
                "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                "extra_key": key,
            },
        )
        outs.append(r.json()["output_ids"])
    assert outs[0] == outs[2] and outs[1] == outs[2]
    st = c.get("/leyline/stats").json()
    assert st["dp_size"] == 2 and len(st["dp_workers"]) == 2
    assert all(w["cached"] > len(base) for w in st["dp_workers"])  # each rank holds its session
    assert st["duplicate_slots"] == 0 and st["tree_and_free_list"] == 0


@pytest.mark.sglang
@pytest.mark.live
def test_dp2_wrong_rank_is_not_reported_as_done(dp_server: str) -> None:
    c = httpx.Client(base_url=dp_server, timeout=600)
    base = seq(80, seed=11)
    key = namespace_on(1, "w")
    gen(c, base, key)
    wrong = splice(c, base, key, dp_rank=0)
    assert wrong.status_code == 409, wrong.text  # rank 0 does not hold it, and says so
    assert splice(c, base, key, dp_rank=2).status_code == 422  # no such rank
    right = splice(c, base, key)  # nothing was touched: the home rank splices it
    assert right.status_code == 200 and right.json()["dp_rank"] == 1
    # a client that pins a request itself names the same rank on its splice
    key2 = namespace_on(1, "explicit")
    r = c.post(
        "/generate",
        json={
            "input_ids": base,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "extra_key": key2,
            "routed_dp_rank": 0,
        },
    )
    assert r.status_code == 200
    assert splice(c, base, key2).status_code == 409  # not on its home rank
    r = splice(c, base, key2, dp_rank=0)
    assert r.status_code == 200 and r.json()["dp_rank"] == 0


@pytest.mark.sglang
def test_dispatch_answers_not_mine_for_another_rank() -> None:
    """The scheduler hook (outside a server its DP rank is 0): a splice or inspect for rank 1 is
    not run here; one for rank 0 or for no rank is."""
    require_sglang()
    from sglang.utils import TypeBasedDispatcher

    from leyline_agent.backends.sglang import ipc, plugin

    class StubScheduler:
        tree_cache = object()

        def __init__(self) -> None:
            self._request_dispatcher = TypeBasedDispatcher([])

    s = StubScheduler()
    plugin.add_splice_dispatch(None, s)
    body = '{"tokens": [1, 2], "directives": [{"start": 0, "end": 1}]}'
    other = s._request_dispatcher(ipc.SpliceReqInput(payload=body, dp_rank=1))
    assert (other.status, other.dp_rank) == (NOT_MINE, 0)
    mine = s._request_dispatcher(ipc.SpliceReqInput(payload=body, dp_rank=0))
    assert mine.status == 501 and mine.dp_rank == 0  # ran (and refused: not a leyline tree)
    assert s._request_dispatcher(ipc.SpliceReqInput(payload=body)).status == 501
    skipped = s._request_dispatcher(ipc.InspectReqInput(payload='{"op": "stats"}', dp_rank=1))
    assert skipped.status == NOT_MINE


def test_pin_to_dp_rank_hook() -> None:
    from types import SimpleNamespace

    from leyline_agent.backends.sglang.plugin import pin_to_dp_rank

    tm = SimpleNamespace(elastic_worker_count=2)
    key = namespace_on(1, "hook")
    obj = SimpleNamespace(
        routed_dp_rank=None, data_parallel_rank=None, extra_key=key, cache_salt=None
    )
    pin_to_dp_rank(tm, obj, None)
    assert obj.routed_dp_rank == 1
    mine = SimpleNamespace(routed_dp_rank=0, extra_key=key, cache_salt=None)
    pin_to_dp_rank(tm, mine)
    assert mine.routed_dp_rank == 0  # the client's own choice stays
    plain = SimpleNamespace(routed_dp_rank=None, extra_key=None, cache_salt=None)
    pin_to_dp_rank(tm, plain)
    assert plain.routed_dp_rank is None  # no namespace: SGLang balances it
    batch = SimpleNamespace(routed_dp_rank=None, extra_key=[key, "x"], cache_salt=None)
    pin_to_dp_rank(tm, batch)
    assert batch.routed_dp_rank is None
    one = SimpleNamespace(elastic_worker_count=1)
    solo = SimpleNamespace(routed_dp_rank=None, extra_key=key, cache_salt=None)
    pin_to_dp_rank(one, obj=solo)
    assert solo.routed_dp_rank is None


@pytest.mark.sglang
@pytest.mark.live
def test_dp2_chat_requests_are_pinned(dp_server: str) -> None:
    """The OpenAI chat path is pinned too (the proxy's and SessionCore's requests): only the home
    rank's cache grows."""
    c = httpx.Client(base_url=dp_server, timeout=600)
    for rank in (0, 1):
        key = namespace_on(rank, "chat")
        before = [w["cached"] for w in c.get("/leyline/stats").json()["dp_workers"]]
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": "default",
                "messages": [{"role": "user", "content": "pin me " * 40}],
                "max_tokens": 1,
                "temperature": 0,
                "extra_key": key,
            },
        )
        assert r.status_code == 200, r.text
        after = [w["cached"] for w in c.get("/leyline/stats").json()["dp_workers"]]
        assert after[rank] > before[rank] + 40 and after[1 - rank] == before[1 - rank]


@pytest.mark.sglang
@pytest.mark.live
def test_dp2_in_band_edit_runs_on_the_rank_the_request_goes_to(dp_server: str) -> None:
    """Issue 28: the ``leyline_splice`` field on ``/generate`` splices on the request's own DP rank
    (its namespace's home rank, or the ``routed_dp_rank`` it names), then the request reads it."""
    c = httpx.Client(base_url=dp_server, timeout=600)
    base = seq(120, seed=11)
    edit = {"tokens": base, "directives": DIRECTIVES}
    for rank in (0, 1):
        key = namespace_on(rank, "inband")
        gen(c, base, key)
        r = c.post("/generate", json={
            "input_ids": edited(base) + [500], "extra_key": key, inband.FIELD: edit,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        })  # fmt: skip
        assert r.status_code == 200, r.text
        result = json.loads(r.headers[inband.RESULT_HEADER])
        assert result["dp_rank"] == rank and result["new_length"] == len(edited(base))
        assert r.json()["meta_info"]["cached_tokens"] == len(edited(base))
        # pinned by hand to the other rank, which does not hold it: refused there, not run
        other = c.post("/generate", json={
            "input_ids": edited(edited(base)) + [500], "extra_key": key,
            "routed_dp_rank": 1 - rank, "sampling_params": {"max_new_tokens": 1},
            inband.FIELD: {"tokens": edited(base), "directives": DIRECTIVES},
        })  # fmt: skip
        assert other.status_code == 409 and other.headers[inband.REFUSED_HEADER] == "409"
