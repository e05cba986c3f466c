"""The SGLang backend against a real ``leyline serve`` on loopback (CPU, embedded tiny DeepSeek-V2,
dummy weights, bf16 KV, 2 layers). KV rows are read back through the debug inspect endpoint."""

from __future__ import annotations

import random

import httpx
import pytest
import torch
from live import (
    VOCAB,
    apply,
    bf16_ulp,
    cached_seq,
    gen,
    ns,
    rows,
    seq,
    splice,
    stats,
    tree_slots,
)

from leyline_agent.embedded.model import EMBEDDED
from leyline_agent.kernels.rope import RopeSpec, rotate

EMBEDDED_CONFIG = EMBEDDED.to_hf()

pytestmark = pytest.mark.sglang

LORA = EMBEDDED_CONFIG["kv_lora_rank"]
ROPE = EMBEDDED_CONFIG["qk_rope_head_dim"]
SPEC = RopeSpec.from_hf_config(EMBEDDED_CONFIG)


@pytest.fixture(scope="module")
def http(leyline_server: str) -> httpx.Client:
    with httpx.Client(base_url=leyline_server, timeout=300) as c:
        yield c


# ---- AMORTIZE --------------------------------------------------------------------------------


@pytest.mark.parametrize("delta", [-6, 0, 5], ids=["delta<0", "delta=0", "delta>0"])
def test_amortize_full_hit_latent_bit_identical_rope_exact(http: httpx.Client, delta: int) -> None:
    key = ns()
    toks = cached_seq(http, 64, seed=delta + 100, key=key)
    before = rows(http, toks, key)
    assert before["cached"] == 64
    s, e = 20, 30
    ds = [{"start": s, "end": e, "replacement": seq(10 + delta, 7)}]
    r = splice(http, toks, ds, key)
    assert r.status_code == 200, r.text
    body = r.json()
    new = apply(toks, ds)
    assert body["new_length"] == len(new)
    assert body["prefix_reused"] == s and body["prefilled"] == 10 + delta
    assert body["rotated"] == 64 - e

    meta = gen(http, new + [4242], key)
    assert meta["cached_tokens"] == len(new)  # every spliced token served from the cache

    after = rows(http, new, key)
    assert after["cached"] == len(new)
    assert after["slots"][:s] == before["slots"][:s]
    for layer in range(EMBEDDED_CONFIG["num_hidden_layers"]):
        old_bits = torch.tensor(before["bits"][layer])
        new_bits = torch.tensor(after["bits"][layer])
        # prefix untouched, downstream latent bit-identical
        assert torch.equal(new_bits[:s], old_bits[:s])
        assert torch.equal(new_bits[e + delta :, :LORA], old_bits[e:, :LORA])
        old_pe = torch.tensor(before["values"][layer], dtype=torch.float64)[e:, LORA:]
        new_pe = torch.tensor(after["values"][layer], dtype=torch.float64)[e + delta :, LORA:]
        exact = rotate(old_pe, torch.full((old_pe.shape[0],), delta), SPEC)
        if delta == 0:
            assert torch.equal(new_pe, old_pe)
        err = (new_pe - exact).abs()
        assert bool((err <= bf16_ulp(exact) + 1e-30).all()), float(err.max())
    assert stats(http)["ok"]


def test_several_directives_at_zero_and_touching_last_token(http: httpx.Client) -> None:
    key = ns()
    toks = cached_seq(http, 70, seed=3, key=key)
    ds = [
        {"start": 0, "end": 3, "replacement": seq(5, 11)},  # at position 0, delta +2
        {"start": 30, "end": 40, "replacement": []},  # pure deletion, delta -10
        {"start": 66, "end": 70, "replacement": seq(2, 12)},  # touches the last token
    ]
    r = splice(http, toks, ds, key)
    assert r.status_code == 200, r.text
    new = apply(toks, ds)
    assert r.json()["new_length"] == len(new) == 70 + 2 - 10 - 2
    assert gen(http, new + [77], key)["cached_tokens"] == len(new)
    assert rows(http, toks, key)["cached"] == 0  # in place: the old sequence left the tree
    assert rows(http, new, key)["cached"] == len(new)
    assert stats(http)["ok"]


def test_several_directives_latent_identity(http: httpx.Client) -> None:
    key = ns()
    toks = cached_seq(http, 50, seed=4, key=key)
    before = rows(http, toks, key)
    ds = [
        {"start": 5, "end": 8, "replacement": seq(1, 13)},
        {"start": 20, "end": 21, "replacement": seq(4, 14)},
    ]
    assert splice(http, toks, ds, key).status_code == 200
    after = rows(http, apply(toks, ds), key)
    for layer in range(EMBEDDED_CONFIG["num_hidden_layers"]):
        ob, nb = torch.tensor(before["bits"][layer]), torch.tensor(after["bits"][layer])
        # new layout: prefix [0,5) | repl [5,6) | middle old [8,20) -> [6,18) (delta -2)
        #             | repl [18,22) | tail old [21,50) -> [22,51) (delta +1)
        ov = torch.tensor(before["values"][layer], dtype=torch.float64)
        nv = torch.tensor(after["values"][layer], dtype=torch.float64)
        for (o0, o1), (n0, n1), d in [((8, 20), (6, 18), -2), ((21, 50), (22, 51), 1)]:
            assert torch.equal(nb[n0:n1, :LORA], ob[o0:o1, :LORA])
            exact = rotate(ov[o0:o1, LORA:], torch.full((o1 - o0,), d), SPEC)
            err = (nv[n0:n1, LORA:] - exact).abs()
            assert bool((err <= bf16_ulp(exact) + 1e-30).all()), float(err.max())


# ---- FORGET ----------------------------------------------------------------------------------


def test_forget_equals_fresh_prefill_and_purges_old_span(http: httpx.Client) -> None:
    key = ns()
    toks = cached_seq(http, 60, seed=5, key=key)
    old = rows(http, toks, key)
    ds = [{"start": 12, "end": 24, "replacement": seq(3, 15), "mode": "forget"}]
    r = splice(http, toks, ds, key)
    assert r.status_code == 200, r.text
    # right away, before later requests may reuse freed slots: no tree path reaches the old span
    assert not tree_slots(http) & set(old["slots"][12:])
    body = r.json()
    new = apply(toks, ds)
    assert body["purged"] >= 60 - 12 and body["prefilled"] == len(new) - 12
    assert gen(http, new + [5], key)["cached_tokens"] == len(new)

    spliced = rows(http, new, key)
    fresh_key = ns()
    gen(http, new, fresh_key)
    fresh = rows(http, new, fresh_key)
    assert fresh["cached"] >= len(new) - 1
    n = min(spliced["cached"], fresh["cached"])
    for layer in range(EMBEDDED_CONFIG["num_hidden_layers"]):
        a = torch.tensor(spliced["values"][layer])[:n]
        b = torch.tensor(fresh["values"][layer])[:n]
        # bf16 storage; the two prefills split the attention differently (prefix cached vs not)
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    assert stats(http)["ok"]


# ---- isolation and sharing -------------------------------------------------------------------


def test_namespaces_never_share_amortized_entries(http: httpx.Client) -> None:
    a, b = ns(), ns()
    toks = seq(50, 6)
    gen(http, toks, a)
    gen(http, toks, b)
    b_before = rows(http, toks, b)
    ds = [{"start": 10, "end": 20, "replacement": seq(4, 16)}]
    assert splice(http, toks, ds, a).status_code == 200
    new = apply(toks, ds)
    assert rows(http, toks, b)["bits"] == b_before["bits"]
    assert gen(http, new + [9], b)["cached_tokens"] == 10  # only the shared prefix, B's own
    assert gen(http, toks + [9], b)["cached_tokens"] == 50
    assert gen(http, new + [9], a)["cached_tokens"] == len(new)


def test_copy_on_write_when_another_path_shares_downstream(http: httpx.Client) -> None:
    key = ns()
    x = seq(60, 8)
    y = x[:40] + seq(15, 9)  # branches off x at 40: [10, 40) is shared
    gen(http, x, key)
    gen(http, y, key)
    y_before = rows(http, y, key)
    ds = [{"start": 10, "end": 15, "replacement": seq(2, 17)}]
    r = splice(http, x, ds, key)
    assert r.status_code == 200, r.text
    assert r.json()["in_place"] is False and r.json()["copied"] == 60 - 15
    assert rows(http, y, key)["bits"] == y_before["bits"]  # the other path, byte for byte
    assert gen(http, y + [1], key)["cached_tokens"] == len(y)
    new = apply(x, ds)
    assert gen(http, new + [1], key)["cached_tokens"] == len(new)
    assert stats(http)["ok"]


# ---- bad input and rollback ------------------------------------------------------------------

BAD_CASES = {
    "end_past_sequence": ([{"start": 10, "end": 41, "replacement": [5]}], None, 400),
    "replacement_id_ge_vocab": ([{"start": 1, "end": 2, "replacement": [VOCAB]}], None, 400),
    "overlapping": (
        [{"start": 1, "end": 5, "replacement": []}, {"start": 4, "end": 6, "replacement": []}],
        None,
        400,
    ),
    "unknown_namespace": ([{"start": 1, "end": 2, "replacement": [5]}], "no-such-ns", 409),
    "negative_start": ([{"start": -1, "end": 2, "replacement": [5]}], None, 422),
    "start_after_end": ([{"start": 5, "end": 2, "replacement": [5]}], None, 422),
    "non_integer_token": ([{"start": 1, "end": 2, "replacement": ["a"]}], None, 422),
    "no_directives": ([], None, 422),
    # longer than the input limit (16,377 of the 16,384-slot pool): 400 before any allocation;
    # the pool-too-small 503 within the limit: test_splice_integrity (a pinned path copied)
    "longer_than_input_limit": ([{"start": 1, "end": 2, "replacement": [7] * 20000}], None, 400),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_is_rejected_and_changes_nothing(http: httpx.Client, case: str) -> None:
    key = ns()
    toks = cached_seq(http, 40, seed=10, key=key)
    ds, other_key, status = BAD_CASES[case]
    before_rows, before_stats = rows(http, toks, key), stats(http)
    r = splice(http, toks, ds, other_key or key)
    assert r.status_code == status, r.text
    assert r.json().get("error")  # a message that says what to fix
    assert rows(http, toks, key) == before_rows
    after_stats = stats(http)
    assert after_stats == before_stats and after_stats["ok"]


def test_token_id_ge_vocab_in_sequence_is_rejected(http: httpx.Client) -> None:
    r = splice(http, [1, 2, VOCAB + 5], [{"start": 0, "end": 1, "replacement": []}], ns())
    assert r.status_code == 400 and "out of range" in r.json()["error"]
    assert stats(http)["ok"]


def test_not_cached_sequence_is_rejected(http: httpx.Client) -> None:
    r = splice(http, seq(30, 99), [{"start": 3, "end": 4, "replacement": [5]}], ns())
    assert r.status_code == 409 and "not cached" in r.json()["error"]


def test_failure_half_way_rolls_back_with_injected_fault(http: httpx.Client) -> None:
    key = ns()
    toks = cached_seq(http, 50, seed=12, key=key)
    before_rows, before_stats = rows(http, toks, key), stats(http)
    ds = [
        {"start": 5, "end": 6, "replacement": seq(3, 18)},
        {"start": 20, "end": 25, "replacement": seq(2, 19)},
    ]
    r = splice(http, toks, ds, key, debug_fail_after_prefill=True)
    assert r.status_code == 500 and "rolled back" in r.json()["error"]
    assert rows(http, toks, key) == before_rows
    assert stats(http) == before_stats
    assert gen(http, toks + [3], key)["cached_tokens"] == 50


# ---- allocator integrity under random traffic ------------------------------------------------


def test_allocator_integrity_after_random_splices_and_generates(http: httpx.Client) -> None:
    rng = random.Random(1234)
    keys = [ns(), ns()]
    live = {k: cached_seq(http, 40, seed=20 + i, key=k) for i, k in enumerate(keys)}
    ops = {"ok": 0, "rejected": 0}
    for step in range(200):
        k = rng.choice(keys)
        toks = live[k]
        if rng.random() < 0.3:
            toks = toks + [rng.randrange(1000, 150000) for _ in range(rng.randrange(1, 6))]
            gen(http, toks, k)
            live[k] = toks
            continue
        start = rng.randrange(0, len(toks))
        end = min(len(toks), start + rng.randrange(0, 8))
        repl = [rng.randrange(1000, 150000) for _ in range(rng.randrange(0, 6))]
        if start == end and not repl:
            continue
        mode = "forget" if rng.random() < 0.2 else "amortize"
        ds = [{"start": start, "end": end, "replacement": repl, "mode": mode}]
        r = splice(http, toks, ds, k)
        if r.status_code == 200:
            ops["ok"] += 1
            live[k] = apply(toks, ds)
            if len(live[k]) < 5:
                live[k] = live[k] + seq(10, step)
                gen(http, live[k], k)
        else:
            ops["rejected"] += 1
            assert r.status_code in (409,), r.text
            gen(http, toks, k)  # re-cache and carry on
        if step % 50 == 49:
            assert stats(http)["ok"], stats(http)
    st = stats(http)
    assert st["ok"] and st["duplicate_slots"] == 0, st
    assert ops["ok"] > 100
    for k, toks in live.items():
        assert gen(http, toks + [1], k)["cached_tokens"] == len(toks)


def test_concurrent_splices_are_in_flight_together_and_answered_each_its_own(
    http: httpx.Client,
) -> None:
    """Eight splices sent at once on eight namespaces (``mux.RidMux``; SGLang's own control
    communicator would queue them one at a time): each reply is its own request's (the
    replacement lengths differ, so ``prefilled`` and ``new_length`` name the request), every
    edited sequence is cached afterwards and the allocator is intact."""
    import asyncio

    keys = [ns() for _ in range(8)]
    seqs = {k: cached_seq(http, 48, seed=300 + i, key=k) for i, k in enumerate(keys)}
    plans = {
        k: [{"start": 10, "end": 14, "replacement": seq(1 + i, 400 + i)}]
        for i, k in enumerate(keys)
    }

    async def all_at_once() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=str(http.base_url), timeout=300) as ac:
            return await asyncio.gather(
                *(
                    ac.post(
                        "/leyline/splice",
                        json={"tokens": seqs[k], "directives": plans[k], "extra_key": k},
                    )
                    for k in keys
                )
            )

    replies = asyncio.run(all_at_once())
    for i, (k, r) in enumerate(zip(keys, replies, strict=True)):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["prefilled"] == 1 + i and body["prefix_reused"] == 10
        assert body["new_length"] == 48 - 4 + 1 + i and body["rotated"] == 48 - 14
        new = apply(seqs[k], plans[k])
        assert gen(http, new + [1], k)["cached_tokens"] == len(new)
    st = http.get("/leyline/stats").json()
    assert st["control"]["in_flight_max"] >= 2, st["control"]  # the queueing one: 1
    assert st["control"]["in_flight"] == 0
    st = stats(http)
    assert st["ok"] and st["duplicate_slots"] == 0, st
