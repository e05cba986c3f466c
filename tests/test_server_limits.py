"""A splice never grows a sequence past the context length, and ``/leyline/stats`` never cries
wolf mid-request. One real ``leyline serve`` (embedded default, dummy weights, debug endpoints)
with ``--context-length 1024`` and ``--chunked-prefill-size 64`` for this module.

Issue 27's given case: on such a server, splices that grew a cached sequence to 1,026 and 1,064
tokens answered 200 (the next request got 400), and a FORGET splice to 1,064 tokens answered 500,
leaked 1,059 slots and SGLang's idle check killed the server.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from live import assert_integrity, gen, seq, splice, stats
from requires import require_sglang

pytestmark = [pytest.mark.sglang, pytest.mark.live]

CONTEXT = 1024


@pytest.fixture(scope="module")
def limited_server() -> Iterator[str]:
    require_sglang()
    from leyline_agent.backends.sglang.launch import EmbeddedServer

    url = os.environ.get("LEYLINE_TEST_LIMITED_SERVER")  # one started by hand with these args
    if url:
        yield url
        return
    args = ["--context-length", str(CONTEXT), "--chunked-prefill-size", "64"]
    env = {"LEYLINE_DEBUG_ENDPOINTS": "1"}
    with EmbeddedServer(max_total_tokens=8192, extra_args=args, env=env) as srv:
        yield srv.url


@pytest.fixture(scope="module")
def http(limited_server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=limited_server, timeout=600) as c:
        yield c


def max_input(c: httpx.Client) -> int:
    """SGLang's scheduler refuses an input of this many tokens or more."""
    return int(c.get("/server_info").json()["max_req_input_len"])


def counts(st: dict[str, Any]) -> tuple[int, int, int]:
    return st["free"], st["cached"], st["evictable"]


def grow_to(tokens: list[int], n: int, mode: str = "amortize") -> list[dict[str, Any]]:
    """One directive replacing tokens [10, 20) so that the sequence becomes ``n`` tokens."""
    return [{"start": 10, "end": 20, "replacement": seq(n - len(tokens) + 10, n), "mode": mode}]


def test_server_limit_is_what_sglang_says(http: httpx.Client) -> None:
    # --context-length 1024: max_req_len 1023, max_req_input_len 1023 - 5 (tp_worker.py)
    assert max_input(http) == CONTEXT - 6


@pytest.mark.parametrize(
    ("n", "mode", "fault"),
    [
        (1026, "amortize", None),
        (1064, "amortize", None),
        (1064, "forget", None),
        (1018, "forget", None),  # the first length no request could send
        (1064, "forget", "prefill.alloc"),  # past the check's reach: a fault mid-prefill
    ],
)
def test_splice_past_the_context_is_refused_and_changes_nothing(
    http: httpx.Client, n: int, mode: str, fault: str | None
) -> None:
    key = f"ctx-{n}-{mode}-{fault}"
    toks = seq(1000, n)
    gen(http, toks, key)
    before = stats(http)
    assert_integrity(before)
    ds = grow_to(toks, n, mode)
    if fault is None:
        r = splice(http, toks, ds, key)
        assert r.status_code == 400, r.text
        err = r.json()["error"]  # SGLang's error format
        assert err["type"] == "invalid_request_error" and err["code"] == 400, err
        assert f"({n} tokens, from 1000)" in err["message"], err
        assert f"maximum input length ({max_input(http) - 1} tokens" in err["message"], err
    else:
        # a FORGET whose re-prefill fails right after its slots were allocated (before
        # SGLang's batch holds them): rolled back, nothing leaked. Shrinking keeps it under the
        # check: [10, 20) -> 4 tokens.
        ds = [{"start": 10, "end": 20, "replacement": seq(4, n), "mode": mode}]
        r = splice(http, toks, ds, key, debug_fault=fault)
        assert r.status_code == 500 and "rolled back" in r.json()["error"], r.text
    after = stats(http)
    assert_integrity(after)
    assert counts(after) == counts(before)
    # the server is alive and the cached sequence is as it was
    assert http.get("/health").status_code == 200
    assert gen(http, toks, key)["cached_tokens"] == len(toks) - 1
    assert_integrity(stats(http))


def test_near_the_limit_the_splice_runs_and_sglang_checks_the_next_request(
    http: httpx.Client,
) -> None:
    """A splice to the longest sendable length (max_req_input_len - 1) answers 200; the next
    request on it is SGLang's to judge: input + max_new_tokens within the context runs (on the
    spliced KV), past it SGLang's own 400."""
    key, limit = "ctx-near", max_input(http)
    toks = seq(1000, 7)
    gen(http, toks, key)
    ds = grow_to(toks, limit - 1)
    r = splice(http, toks, ds, key)
    assert r.status_code == 200, r.text
    new = toks[:10] + ds[0]["replacement"] + toks[20:]
    assert r.json()["new_length"] == len(new) == limit - 1
    assert_integrity(stats(http))
    # 1017 + 64 > 1024: SGLang's tokenizer manager refuses it (nothing runs)
    over = http.post(
        "/generate",
        json={
            "input_ids": new,
            "sampling_params": {"max_new_tokens": 64, "temperature": 0},
            "extra_key": key,
        },
    )
    assert over.status_code == 400, over.text
    assert "context length" in over.json()["error"]["message"], over.text
    # 1017 + 4 fits: it runs on the spliced sequence (all but the last token cached)
    meta = gen(http, new, key, max_new_tokens=4, ignore_eos=True)
    assert meta["cached_tokens"] == len(new) - 1 and meta["completion_tokens"] == 4, meta
    assert_integrity(stats(http))
    # a FORGET to the same length runs too (its re-prefill fits the request row)
    toks2 = seq(1000, 8)
    gen(http, toks2, key)
    r = splice(http, toks2, grow_to(toks2, limit - 1, "forget"), key)
    assert r.status_code == 200 and r.json()["new_length"] == limit - 1, r.text
    assert_integrity(stats(http))


def test_a_splice_that_shrinks_a_long_sequence_is_not_refused(http: httpx.Client) -> None:
    """The check refuses growth past the limit, not a sequence already there (a prompt plus
    its reply can be cached longer than any input): 1,000 + 20 generated -> minus 10 tokens."""
    key = "ctx-shrink"
    toks = seq(1000, 9)
    out = http.post(
        "/generate",
        json={
            "input_ids": toks,
            "sampling_params": {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True},
            "extra_key": key,
        },
    ).json()
    full = toks + out["output_ids"][:-1]  # the last generated token has no KV yet
    assert len(full) == 1019 >= max_input(http)
    ds = [{"start": 10, "end": 20, "replacement": [], "mode": "amortize"}]
    r = splice(http, full, ds, key)
    assert r.status_code == 200 and r.json()["new_length"] == 1009, r.text
    assert_integrity(stats(http))


# ---- the integrity monitor under real requests in flight ------------------------------------


def poll_while(http: httpx.Client, work: Any) -> tuple[collections.Counter[str], list[dict]]:
    """Run ``work()`` in a thread and read ``/leyline/stats`` until it is done: the busy states
    seen (how often), and every answer with ``ok`` False."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as e:  # re-raised below
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    seen: collections.Counter[str] = collections.Counter()
    bad = []
    while t.is_alive():
        st = http.get("/leyline/stats").json()
        for b in st["busy"] or ["idle"]:
            seen[b] += 1
        if st["ok"] is False:
            bad.append(st)
        if st["busy"]:
            assert st["idle"] is False and st["ok"] is None, st
    t.join()
    if errors:
        raise errors[0]
    return seen, bad


def test_stats_during_a_chunked_prefill_and_a_stream_is_busy_not_broken(
    http: httpx.Client, limited_server: str
) -> None:
    """A 1,000-token prompt in 64-token chunks (a chunked request between chunks is in neither
    batch; the batch just run holds a new request's slots until the next iteration merges it):
    the stock monitor answered ok false here. Now every answer is ok or busy."""

    def long_prompt() -> None:
        with httpx.Client(base_url=limited_server, timeout=600) as c:
            body = {
                "input_ids": seq(1000, 11),
                "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
                "stream": True,
            }
            with c.stream("POST", "/generate", json=body) as r:
                assert r.status_code == 200
                chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
            assert chunks, "the stream sent nothing"

    seen, bad = poll_while(http, long_prompt)
    assert bad == [], bad[:2]
    assert seen["chunked_req"] > 0, seen
    assert seen["running_batch"] > 0, seen
    assert_integrity(stats(http))


def test_stats_while_a_grammar_compiles_is_busy_not_broken(
    http: httpx.Client, limited_server: str
) -> None:
    """A request with a JSON schema waits in SGLang's grammar queue while its grammar compiles
    (asynchronously): busy, named ``grammar_queue``."""
    schema = {
        "type": "object",
        "properties": {f"field_{i}": {"type": "string", "maxLength": 8} for i in range(12)},
        "required": [f"field_{i}" for i in range(12)],
    }

    def constrained() -> None:
        with httpx.Client(base_url=limited_server, timeout=600) as c:
            r = c.post(
                "/generate",
                json={
                    "input_ids": seq(50, 12),
                    "sampling_params": {
                        "max_new_tokens": 8,
                        "temperature": 0,
                        "json_schema": __import__("json").dumps(schema),
                    },
                },
            )
            assert r.status_code == 200, r.text

    seen, bad = poll_while(http, constrained)
    assert bad == [], bad[:2]
    assert seen["grammar_queue"] > 0, seen
    assert_integrity(stats(http))
