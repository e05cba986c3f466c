"""Helpers for tests against a real ``leyline serve`` (HTTP on loopback): requests, KV rows read
back through the debug inspect endpoint, and the integrity counters of ``/leyline/stats``."""

from __future__ import annotations

import random
import uuid
from typing import Any

import httpx

from leyline_agent.directive import Directive, apply_directives
from leyline_agent.testing.numerics import bf16_ulp  # noqa: F401  (re-exported for tests)

VOCAB = 200064


def ns() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


def seq(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 150000) for _ in range(n)]


def gen(
    c: httpx.Client, ids: list[int], key: str | None, max_new_tokens: int = 1, **sampling: Any
) -> dict[str, Any]:
    r = c.post(
        "/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, **sampling},
            "extra_key": key,
        },
    )
    r.raise_for_status()
    return r.json()["meta_info"]


def splice(
    c: httpx.Client, tokens: list[int], ds: list[dict[str, Any]], key: str | None, **kw: Any
):
    return c.post(
        "/leyline/splice", json={"tokens": tokens, "directives": ds, "extra_key": key, **kw}
    )


def rows(c: httpx.Client, tokens: list[int], key: str | None) -> dict[str, Any]:
    r = c.post("/leyline/debug/inspect", json={"op": "rows", "tokens": tokens, "extra_key": key})
    r.raise_for_status()
    return r.json()


def stats(c: httpx.Client) -> dict[str, Any]:
    """Integrity counters once the server is idle (see ``invariants.idle_stats``)."""
    from leyline_agent.testing.invariants import idle_stats

    return idle_stats(c)


def tree_slots(c: httpx.Client) -> set[int]:
    r = c.post("/leyline/debug/inspect", json={"op": "tree_slots"})
    r.raise_for_status()
    return set(r.json()["slots"])


def apply(tokens: list[int], ds: list[dict[str, Any]]) -> list[int]:
    return apply_directives(tokens, [Directive.model_validate(d) for d in ds])


def cached_seq(c: httpx.Client, n: int, seed: int, key: str) -> list[int]:
    toks = seq(n, seed)
    gen(c, toks, key)
    return toks


def assert_integrity(st: dict[str, Any]) -> None:
    """Idle-server invariants: free + cached == total, no slot owned twice, no lock left but the
    pins'."""
    assert st["ok"], st
    assert st["duplicate_slots"] == 0 and st["tree_and_free_list"] == 0, st
    assert st["free"] + st["cached"] == st["total"], st
    # the only locks left on an idle server are the pins' (other tests' sessions pin with a TTL)
    assert st["evictable"] + st["protected"] == st["cached"], st
    assert st["protected"] == st.get("pinned_slots", 0), st
    assert st["sglang_idle_check"], st
