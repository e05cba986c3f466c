"""A splice on a ``leyline serve --tp-size 2`` (CPU: two scheduler processes over gloo, the CPU
dev mode's parallel-group patch; ``docs/scale-out.md``).

Every TP rank's scheduler receives the splice (rank 0 broadcasts it), runs it on its own tree and
KV, and the replacement prefill is a collective forward; only rank 0 answers. The debug routes
read rank 0's rows, so rank 1 is checked through the model: the attention output is an all-reduce
over both ranks' heads, so the next request's greedy tokens equal a fresh prefill's only if both
ranks hold the right KV, and the next request is a full cache hit only if both trees agree.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from live import gen, seq
from requires import require_sglang

from leyline_agent.backends.sglang.launch import EmbeddedServer

pytestmark = [pytest.mark.sglang, pytest.mark.live]

DIRECTIVES = [
    {"start": 20, "end": 30, "replacement": [11, 12, 13]},
    {"start": 100, "end": 101, "replacement": [21, 22, 23, 24]},
]


@pytest.fixture(scope="module")
def tp_server() -> Iterator[str]:
    require_sglang()
    srv = EmbeddedServer(
        max_total_tokens=8192, extra_args=["--tp-size", "2"], env={"LEYLINE_DEBUG_ENDPOINTS": "1"}
    )
    with srv:
        yield srv.url


def test_tp2_splice_matches_fresh_prefill(tp_server: str) -> None:
    c = httpx.Client(base_url=tp_server, timeout=600)
    base = seq(200, seed=5)
    gen(c, base, "tp-s")
    r = c.post(
        "/leyline/splice", json={"tokens": base, "directives": DIRECTIVES, "extra_key": "tp-s"}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["in_place"] is True and body["prefilled"] == 7
    new = base[:20] + [11, 12, 13] + base[30:100] + [21, 22, 23, 24] + base[101:]
    assert body["new_length"] == len(new)

    def greedy(key: str) -> tuple[list[int], int]:
        r = c.post(
            "/generate",
            json={
                "input_ids": new + [500, 501],
                "sampling_params": {"max_new_tokens": 8, "temperature": 0},
                "extra_key": key,
            },
        )
        r.raise_for_status()
        return r.json()["output_ids"], r.json()["meta_info"]["cached_tokens"]

    spliced, hit = greedy("tp-s")
    fresh, cold = greedy("tp-ref")
    assert hit == len(new) and cold == 0
    assert spliced == fresh

    def rows(key: str) -> list:
        r = c.post("/leyline/debug/inspect", json={"op": "rows", "tokens": new, "extra_key": key})
        assert r.status_code == 200, r.text
        assert r.json()["cached"] == len(new)
        return r.json()["values"]

    a, b = rows("tp-s"), rows("tp-ref")  # rank 0's rows: [layers][tokens][columns]
    worst = max(
        abs(x - y)
        for la, lb in zip(a, b, strict=True)
        for ra, rb in zip(la, lb, strict=True)
        for x, y in zip(ra, rb, strict=True)
    )
    assert worst < 0.05, worst  # bf16 rows: a rotated row is within a few ulps of a fresh one
    st = c.get("/leyline/stats").json()
    assert st["duplicate_slots"] == 0 and st["tree_and_free_list"] == 0
