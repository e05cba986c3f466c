"""Splices on paged KV pools (``--page-size 16`` and ``64``), on MLA (the embedded default) and
GQA (tiny Qwen3, ``tiny_models``): one real ``leyline serve`` per configuration, started one at
a time (module-scoped), each with a 4,096-token pool.

On each: deltas that are and are not page multiples, edits at a page boundary, inside a page and
in the first page, two directives; the tree then holds the edit's full pages, page-contiguous,
``slot % page == position % page``; every kept row outside the rope band (MLA's latent, K's other
dims) and V bit-identical to its source row, the band within 1 bf16 ulp of the exact rotation;
the next request hits every held page. FORGET equals a fresh prefill and purges whole pages. Bad
input a 4xx with nothing changed, ``/leyline/stats`` ok after each (``testing/paged_check.py``).
A short seeded fuzz at page 16 (``testing/splice_fuzz.py``; 10,000 operations in
``experiments/backend/fuzz_splice.py --page-size 16``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live import assert_integrity, gen, ns, rows, seq, splice, stats
from requires import require_sglang

from leyline_agent.testing import paged_check

pytestmark = [pytest.mark.sglang, pytest.mark.live]

CONFIGS = [("mla", 16), ("mla", 64), ("qwen3", 16), ("qwen3", 64)]


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{m}-page{p}" for m, p in CONFIGS])
def paged(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[httpx.Client, int]]:
    require_sglang()
    from leyline_agent.backends.sglang.launch import EmbeddedServer
    from leyline_agent.testing.tiny_models import write_tiny_model

    model, page = request.param
    extra = ["--page-size", str(page)]
    model_path: Path | None = None
    if model != "mla":
        model_path = write_tiny_model(tmp_path_factory.mktemp(model) / model, model)
        extra.append("--dummy")
    with (
        EmbeddedServer(
            model_path=model_path,
            max_total_tokens=4096,
            extra_args=extra,
            env={"LEYLINE_DEBUG_ENDPOINTS": "1"},
        ) as srv,
        httpx.Client(base_url=srv.url, timeout=600) as c,
    ):
        yield c, page


def cases(p: int) -> dict[str, tuple[int, list[dict]]]:
    """Name -> (cached length, directives) for page size ``p``; lengths leave a partial page."""
    n = 5 * p + 7
    return {
        "delta_page_multiple_inside_page": (n, [{"start": p + 5, "end": 2 * p + 5, "replacement": []}]),
        "delta_page_multiple_at_boundary": (n, [{"start": 2 * p, "end": 2 * p, "replacement": list(range(2000, 2000 + p))}]),
        "delta_odd_inside_page": (n, [{"start": p + 5, "end": p + 11, "replacement": [5, 6, 7]}]),
        "delta_odd_at_boundary": (n, [{"start": 2 * p, "end": 2 * p + 8, "replacement": [5]}]),
        "first_page": (n, [{"start": 2, "end": 5, "replacement": [9]}]),
        "two_directives": (n, [
            {"start": 3, "end": 7, "replacement": [1, 2, 3, 4, 5, 6, 7]},
            {"start": 2 * p + 1, "end": 2 * p + 11, "replacement": [8]},
        ]),
    }  # fmt: skip


def test_amortize_keeps_rows_exact_on_pages(paged: tuple[httpx.Client, int]) -> None:
    c, page = paged
    for seed, (name, (n, ds)) in enumerate(cases(page).items()):
        got = paged_check.check_splice(c, page, n, ds, seed=seed + 1)
        assert got["rows_checked"] > 0 and got["band_max_ulp"] <= 1.0, (name, got)
        assert got["prefix_reused"] % page == 0 and got["in_place"], (name, got)
        print(json.dumps({"case": name, "page": page, **got}))  # the figures (pytest -s)
    # a page-multiple delta keeps the tail's pages in place; any other delta moves every row
    mult = paged_check.check_splice(c, page, 5 * page + 7, cases(page)["delta_odd_inside_page"][1])
    assert mult["copied"] == mult["rotated"]
    tail = paged_check.check_splice(
        c, page, 5 * page + 7, cases(page)["delta_page_multiple_inside_page"][1]
    )
    assert tail["copied"] < page <= tail["rotated"]


def test_forget_is_a_fresh_prefill_purging_whole_pages(paged: tuple[httpx.Client, int]) -> None:
    c, page = paged
    n = 4 * page + 3
    inside = paged_check.check_forget(
        c, page, n, {"start": page + 3, "end": page + 9, "replacement": [3, 4]}
    )
    # 4 pages held; from page 1 on purged (3 pages), the edit's 4p - 4 tokens hold 3 pages
    assert inside["forget_rows"] == 3 * page and inside["purged"] == 3 * page
    first = paged_check.check_forget(c, page, n, {"start": 1, "end": 2, "replacement": []})
    assert first["forget_rows"] == 3 * page and first["purged"] == 4 * page
    print(json.dumps({"page": page, "inside": inside, "first": first}))


def test_forget_in_the_partial_page_purges_the_pages_below(paged: tuple[httpx.Client, int]) -> None:
    """The tree holds 4 pages of 4p + 3 tokens and, below them, the reply's page, which starts
    with the 3 uncached tokens. A FORGET of one of those purges that page (the old sequence with
    its reply is then held to 4 pages), and leaves the 4 pages and their rows as they were."""
    c, page = paged
    key, toks = ns(), seq(4 * page + 3, 77)
    out = c.post(
        "/generate",
        json={
            "input_ids": toks,
            "sampling_params": {"max_new_tokens": page + 2, "temperature": 0, "ignore_eos": True},
            "extra_key": key,
        },
    ).json()
    full = toks + list(out["output_ids"])
    assert rows(c, full, key)["cached"] == 5 * page  # 5p + 4 of 5p + 5 tokens: 5 pages
    before = rows(c, toks, key)
    d = {"start": 4 * page + 1, "end": 4 * page + 2, "replacement": [], "mode": "forget"}
    r = splice(c, toks, [d], key)
    assert r.status_code == 200, r.text
    assert r.json()["purged"] == page
    assert rows(c, full, key)["cached"] == 4 * page
    assert rows(c, toks, key) == before
    assert_integrity(stats(c))


def test_fork_copies_whole_pages(paged: tuple[httpx.Client, int]) -> None:
    """A fork (a splice with no directive into another namespace) copies the held pages to fresh
    ones, bit for bit, page-contiguous; the source is untouched."""
    c, page = paged
    key, child, toks = ns(), ns(), seq(3 * page + 5, 31)
    gen(c, toks, key)
    src = rows(c, toks, key)
    r = c.post("/leyline/fork", json={"tokens": toks, "extra_key": key, "target_extra_key": child})
    assert r.status_code == 200, r.text
    got = rows(c, toks, child)
    assert got["cached"] == 3 * page and got["bits"] == src["bits"]
    assert not set(got["slots"]) & set(src["slots"])
    paged_check.check_layout(got, page)
    assert rows(c, toks, key) == src
    assert_integrity(stats(c))


def test_pin_refused_on_pages_changing_nothing(paged: tuple[httpx.Client, int]) -> None:
    """Pins are refused on a paged pool (501, before any lock): nothing pinned, rows, slots and
    counters as before, and the pinned prefix is still an ordinary evictable one."""
    c, page = paged
    key, toks = ns(), seq(3 * page, 41)
    gen(c, toks, key)
    before, st0 = rows(c, toks, key), stats(c)
    assert before["cached"] == 3 * page
    for tokens in (toks, toks[: 2 * page], toks[: page + 1]):
        r = c.post("/leyline/pin", json={"tokens": tokens, "extra_key": key, "ttl_s": 60})
        assert r.status_code == 501, r.text
        assert f"--page-size 1 (server has {page})" in r.json()["error"], r.text
    assert rows(c, toks, key) == before and stats(c) == st0
    assert st0["pinned_slots"] == 0 and st0["protected"] == 0
    assert_integrity(st0)


def test_bad_input_changes_nothing_on_pages(paged: tuple[httpx.Client, int]) -> None:
    c, page = paged
    got = paged_check.check_bad_input(c, page)
    assert set(got.values()) <= {400, 422} and len(got) == 4, got
    # shorter than a page: the tree holds none of it, a splice has nothing to edit
    key, short = ns(), seq(page - 3, 12)
    gen(c, short, key)
    st0 = stats(c)
    r = splice(c, short, [{"start": 1, "end": 2, "replacement": [5]}], key)
    assert r.status_code == 409 and "only 0 of" in r.json()["error"], r.text
    assert stats(c) == st0
    assert_integrity(stats(c))


def test_short_fuzz_on_pages(paged: tuple[httpx.Client, int]) -> None:
    """Seeded random traffic (generate, 1-4 AMORTIZE/FORGET directives, other namespaces,
    flushes) with the idle invariants after every step and the KV rows on every third step that
    splices: MLA's latent, or V and K outside the rope band (GQA), bit-identical; the band within 1
    ulp of the exact rotation, with the RoPE spec and band the server reports."""
    c, page = paged
    from leyline_agent.testing.splice_fuzz import SpliceFuzzer

    c.post("/flush_cache")
    fz = SpliceFuzzer(str(c.base_url), 3, check_rows_every=3, page=page)
    try:
        rep = fz.run(60)
    finally:
        fz.close()
    assert rep.steps == 60
    assert rep.statuses["splice 200"] >= 10, rep.as_dict()
    assert rep.rows_checked > 0, rep.as_dict()
    print(json.dumps({"page": page, **rep.as_dict()}))
