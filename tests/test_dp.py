"""DP inside one server (``--dp-size``): pinning a namespace to a rank, picking a worker's reply,
merging stats (``backends/sglang/dp.py``; pure, no server). The live ``--dp-size 2`` test runs when
``LEYLINE_TEST_DP=1`` (it starts its own two-rank server; see ``docs/scale-out.md``)."""

from __future__ import annotations

import collections

import pytest

from leyline_agent.backends.sglang.dp import (
    NOT_MINE,
    Reply,
    home_rank,
    merge_stats,
    namespace_key,
    pick_reply,
)


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
