"""Issue 16, server side, against a real ``leyline serve``: a splice from one namespace into
another (exact KV shared, amortized KV private), FORK (``/leyline/fork``) and PIN
(``/leyline/pin``, ``/leyline/unpin``), each with its bad input refused and nothing changed."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from live import apply, assert_integrity, gen, ns, rows, seq, splice, stats

from leyline_agent.directive import Directive
from leyline_agent.embedded.model import EMBEDDED
from leyline_agent.kernels.rope import RopeSpec
from leyline_agent.testing.invariants import check_rows

pytestmark = pytest.mark.sglang

LORA = EMBEDDED.to_hf()["kv_lora_rank"]
SPEC = RopeSpec.from_hf_config(EMBEDDED.to_hf())


@pytest.fixture()
def http(leyline_server: str) -> Iterator[httpx.Client]:
    """The session's server, emptied first: pins other modules' sessions left (with their TTL)
    would move the counters these tests compare."""
    with httpx.Client(base_url=leyline_server, timeout=600) as c:
        for _ in range(240):  # SGLang refuses while a request runs
            if c.post("/flush_cache").status_code == 200:
                break
            time.sleep(0.5)
        assert stats(c)["pins"] == 0
        yield c


def post(c: httpx.Client, route: str, **body: Any) -> httpx.Response:
    return c.post(f"/leyline/{route}", json=body)


def unchanged(c: httpx.Client, before: dict[str, Any]) -> None:
    """The counters a refused request must not move."""
    after = stats(c)
    keys = ("free", "cached", "protected", "pins", "pinned_slots")
    assert {k: after[k] for k in keys} == {k: before[k] for k in keys}


def test_splice_into_a_private_namespace_leaves_the_shared_path_and_is_invisible_to_it(
    http: httpx.Client,
) -> None:
    shared, private = ns(), ns()
    toks = seq(300, 1)
    gen(http, toks, shared)
    before = rows(http, toks, shared)
    ds = [
        {"start": 40, "end": 60, "replacement": seq(4, 2)},
        {"start": 200, "end": 205, "replacement": []},
    ]
    r = splice(http, toks, ds, shared, target_extra_key=private)
    assert r.status_code == 200, r.text
    body = r.json()
    new = apply(toks, ds)
    assert body["new_length"] == len(new) == 279
    assert body["copied_prefix"] == 40 and body["prefix_reused"] == 40
    assert body["in_place"] is False and body["prefilled"] == 4
    assert body["rotated"] == 300 - 40 - 25 and body["copied"] == body["rotated"]
    # the private path: the prefix bit for bit, downstream rotated by its shift
    after = rows(http, new, private)
    assert after["cached"] == len(new)
    assert after["bits"][0][:40] == before["bits"][0][:40]
    assert check_rows(before, after, [Directive.model_validate(d) for d in ds], LORA, SPEC) > 0
    assert not set(after["slots"]) & set(before["slots"])  # no slot shared across namespaces
    # the shared path is exactly as it was
    again = rows(http, toks, shared)
    assert again["slots"] == before["slots"] and again["bits"] == before["bits"]
    # isolation: the shared namespace sending exactly the spliced tokens hits its exact prefix
    # only, never the amortized KV; the private namespace hits all of it
    assert gen(http, new + [7], shared)["cached_tokens"] == 40
    assert gen(http, new + [7], private)["cached_tokens"] == len(new)
    assert_integrity(stats(http))


def test_forget_across_namespaces_purges_the_span_from_the_source(http: httpx.Client) -> None:
    shared, private = ns(), ns()
    toks = seq(120, 3)
    gen(http, toks, shared)
    ds = [{"start": 50, "end": 70, "replacement": seq(3, 4), "mode": "forget"}]
    r = splice(http, toks, ds, shared, target_extra_key=private)
    assert r.status_code == 200, r.text
    assert r.json()["purged"] >= 120 - 50 and r.json()["copied_prefix"] == 50
    new = apply(toks, ds)
    assert rows(http, new, private)["cached"] == len(new)
    assert rows(http, toks, shared)["cached"] == 50  # the removed span is gone from the source
    assert_integrity(stats(http))


def test_fork_copies_and_the_child_never_touches_the_parent(http: httpx.Client) -> None:
    parent, child = ns(), ns()
    toks = seq(200, 5)
    gen(http, toks, parent)
    p_rows = rows(http, toks, parent)
    r = post(http, "fork", tokens=toks, extra_key=parent, target_extra_key=child)
    assert r.status_code == 200, r.text
    assert r.json()["new_length"] == 200 and r.json()["copied"] == 200
    c_rows = rows(http, toks, child)
    assert c_rows["cached"] == 200 and c_rows["bits"] == p_rows["bits"]
    assert not set(c_rows["slots"]) & set(p_rows["slots"])
    assert gen(http, toks + [9], child)["cached_tokens"] == 200
    again = post(http, "fork", tokens=toks, extra_key=parent, target_extra_key=child)
    assert again.status_code == 200 and again.json()["copied"] == 0  # the child held it all
    assert rows(http, toks, child)["slots"] == c_rows["slots"]
    # the child's own splice (in place: it owns its copy) leaves the parent as it was
    ds = [{"start": 10, "end": 30, "replacement": seq(2, 6)}]
    r = splice(http, toks, ds, child)
    assert r.status_code == 200, r.text
    assert rows(http, apply(toks, ds), child)["cached"] == 182
    again = rows(http, toks, parent)
    assert again["slots"] == p_rows["slots"] and again["bits"] == p_rows["bits"]
    assert gen(http, toks + [9], parent)["cached_tokens"] == 200
    assert_integrity(stats(http))


def test_fork_bad_input_is_refused_and_changes_nothing(http: httpx.Client) -> None:
    parent = ns()
    toks = seq(50, 7)
    gen(http, toks, parent)
    st = stats(http)
    cases = [
        ({"tokens": seq(50, 8), "extra_key": parent, "target_extra_key": ns()}, 409),
        ({"tokens": toks, "extra_key": ns(), "target_extra_key": ns()}, 409),  # unknown ns
        ({"tokens": toks, "extra_key": parent, "target_extra_key": parent}, 422),
        ({"tokens": toks, "extra_key": parent}, 422),
        ({"tokens": [10**9], "extra_key": parent, "target_extra_key": ns()}, 400),
    ]
    for body, status in cases:
        r = http.post("/leyline/fork", json=body)
        assert r.status_code == status, (body, r.text)
        assert "error" in r.json() and "input" not in r.text  # no echo of the token list
        unchanged(http, st)
    assert "child's first request" in http.post("/leyline/fork", json=cases[0][0]).json()["error"]
    assert_integrity(stats(http))


def test_pin_keeps_a_prefix_resident_under_pressure_until_unpinned(http: httpx.Client) -> None:
    http.post("/flush_cache")
    total = stats(http)["total"]
    kept, lost = ns(), ns()
    a, b = seq(1500, 11), seq(1500, 12)
    gen(http, a, kept)
    gen(http, b, lost)
    r = post(http, "pin", tokens=a[:1200], extra_key=kept, ttl_s=300, owner="agent-1")
    assert r.status_code == 200, r.text
    pin = r.json()
    assert pin["pinned_tokens"] == 1200 and pin["pinned_slots"] == 1200
    assert pin["pin_cap_slots"] == total // 2 and pin["expires_at"] > time.time() + 290
    st = stats(http)
    assert st["pins"] == 1 and st["pinned_slots"] == 1200 and st["protected"] == 1200
    assert st["ok"]  # idle with a pin: its lock is the only one
    for i in range(total // 1500 + 2):  # more than the pool: LRU evicts everything it may
        gen(http, seq(1500, 100 + i), ns())
    assert rows(http, a, kept)["cached"] == 1200  # the pinned prefix survived
    assert rows(http, b, lost)["cached"] == 0  # the unpinned one did not
    assert gen(http, a[:1200] + [5], kept)["cached_tokens"] == 1200
    r = post(http, "unpin", pin_id=pin["pin_id"])
    assert r.status_code == 200 and r.json() == {"released": 1, "pinned_slots": 0}
    assert post(http, "unpin", pin_id=pin["pin_id"]).status_code == 404
    assert_integrity(stats(http))


def test_pin_expires_owner_release_and_forget_over_a_pin(http: httpx.Client) -> None:
    key = ns()
    toks = seq(100, 21)
    gen(http, toks, key)
    r = post(http, "pin", tokens=toks, extra_key=key, ttl_s=1.0)
    assert r.status_code == 200, r.text
    time.sleep(1.5)
    assert stats(http)["pins"] == 0  # the TTL passed
    for _ in range(2):
        assert post(http, "pin", tokens=toks[:60], extra_key=key, ttl_s=60, owner="s").is_success
    assert stats(http)["pins"] == 2
    assert post(http, "unpin", owner="s").json()["released"] == 2
    assert post(http, "unpin", owner="s").json()["released"] == 0
    # a pinned span is copied around by an AMORTIZE splice and released by a FORGET of it
    pin = post(http, "pin", tokens=toks, extra_key=key, ttl_s=60).json()
    r = splice(http, toks, [{"start": 5, "end": 10, "replacement": []}], key)
    assert r.status_code == 200 and r.json()["in_place"] is False
    assert rows(http, toks, key)["cached"] == 100  # the pinned old path is still there
    r = splice(http, toks, [{"start": 50, "end": 60, "replacement": [], "mode": "forget"}], key)
    assert r.status_code == 200, r.text
    assert stats(http)["pins"] == 0
    assert post(http, "unpin", pin_id=pin["pin_id"]).status_code == 404
    assert_integrity(stats(http))


def test_pin_bad_input_and_the_cap_are_refused_and_change_nothing(http: httpx.Client) -> None:
    http.post("/flush_cache")
    total = stats(http)["total"]
    key = ns()
    n = total // 2 - 100  # two of these exceed half the pool
    a, b = seq(n, 31), seq(n, 32)
    gen(http, a, key)
    gen(http, b, key)
    first = post(http, "pin", tokens=a, extra_key=key, ttl_s=60)
    assert first.status_code == 200, first.text
    st = stats(http)
    cases = [
        ({"tokens": b, "extra_key": key, "ttl_s": 60}, 429),  # over the cap
        ({"tokens": seq(20, 33), "extra_key": key, "ttl_s": 60}, 409),  # not cached
        ({"tokens": a, "extra_key": ns(), "ttl_s": 60}, 409),  # unknown namespace
        ({"tokens": a, "extra_key": key, "ttl_s": 0}, 422),
        ({"tokens": a, "extra_key": key, "ttl_s": 86401}, 422),
        ({"tokens": a, "extra_key": key}, 422),
        ({"tokens": a, "extra_key": key, "ttl_s": 5, "colour": 1}, 422),
    ]
    for body, status in cases:
        r = http.post("/leyline/pin", json=body)
        assert r.status_code == status, (body, r.text)
        assert "error" in r.json()
        unchanged(http, st)
    assert "cap" in http.post("/leyline/pin", json=cases[0][0]).json()["error"]
    for body, status in [
        ({"pin_id": "p0-nope"}, 404),
        ({}, 422),
        ({"pin_id": "x", "owner": "y"}, 422),
    ]:
        assert http.post("/leyline/unpin", json=body).status_code == status
        unchanged(http, st)
    assert post(http, "unpin", pin_id=first.json()["pin_id"]).status_code == 200
    assert_integrity(stats(http))
