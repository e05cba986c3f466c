"""Composed splices (``bench/fidelity/composed.py``): the edit plan (pure), and one session on
the embedded model edited 1 and 5 times in succession on a real server (mechanics, not the
agreement rate: the weights are random)."""

from __future__ import annotations

import random

import pytest

from leyline_agent.bench.fidelity import composed as cp
from leyline_agent.bench.fidelity.traces import Case, TraceFidelitySpec


def test_edits_are_disjoint_spans_and_compose_to_the_one_shot_edit() -> None:
    toks = list(range(1000, 1400))
    ds = cp.edits(len(toks), 20, filler=7)
    assert len(ds) == 20 and all(d.end - d.start == 3 and d.replacement == (7,) for d in ds)
    assert all(a.end < b.start for a, b in zip(ds, ds[1:], strict=False))
    assert ds[0].start >= 80 and ds[-1].end <= 400 - 16  # between 20% and the last 16 tokens
    one = cp.apply(toks, ds)
    assert len(one) == 400 - 2 * 20
    cur = toks
    for k in range(len(ds)):  # each edit at its shifted position in the previous result
        d = cp.shifted(ds, k)
        assert cur[d.start : d.end] == toks[ds[k].start : ds[k].end]
        cur = cp.apply(cur, [d])
    assert cur == one
    with pytest.raises(ValueError, match="do not fit"):
        cp.edits(60, 20, filler=7)


@pytest.mark.sglang
def test_composed_session_on_the_embedded_model(leyline_server: str) -> None:
    """On the session's server (the embedded model): each session uses its own namespaces."""
    from leyline_agent.client import LeylineClient

    rng = random.Random(3)
    full = [rng.randrange(1000, 40000) for _ in range(300)]
    case = Case("synthetic", 0, "none", 0, full, full, [])
    spec = TraceFidelitySpec(new_tokens=4, top_k=5)
    with LeylineClient(leyline_server) as client:
        rows = cp.run_session(client, case, spec, filler=999, steps=(1, 5))
    assert [r["steps"] for r in rows] == [1, 5]
    for r in rows:
        n = r["steps"]
        assert r["final_len"] == 300 - 2 * n
        assert r["composed_cached"] >= r["final_len"] - 1  # the last splice's result is cached
        assert r["prefilled"] >= n and r["rotated"] > 0  # each splice prefilled its filler
        assert len(r["composed"]) == len(r["oneshot"]) == len(r["full"]) == 4
    s = cp.summarize(rows)
    assert set(s) == {"1", "5"} and all(v["composed_cached"]["k"] == 1 for v in s.values())
