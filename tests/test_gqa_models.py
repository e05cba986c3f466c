"""Splices beyond MLA: one real ``leyline serve`` per model family (tiny GQA configs shaped like
the released ones, dummy weights, bf16, 2 layers, a 4,096-token pool), started one at a time.

On each: AMORTIZE leaves the whole spliced sequence cached, K's rotary dims within 1 bf16 ulp of
the exact rotation of the old rows (with the spec the server reports, which must match the HF
config), K's other dims and V bit-identical; FORGET equals a fresh prefill; bad input is refused
with a 4xx and changes nothing (``leyline_agent/testing/model_check.py``). The same on an fp8 KV
cache (dequantize, rotate, quantize: within one fp8 ulp). And what a splice
cannot edit is refused with 501 and a reason before anything is allocated, the cache, its
counters and the scheduler as before: a model with sliding-window layers
(Gemma-2: every other layer has a 64-token window). Paged pools: ``tests/test_paged_splice.py``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from live import assert_integrity, gen, ns, rows, seq, splice, stats
from requires import require_sglang

from leyline_agent.kernels.rope import RopeSpec, inv_freq
from leyline_agent.testing import model_check
from leyline_agent.testing.tiny_models import (
    EXPECTED_ROPE,
    FAMILIES,
    REFUSED_FAMILIES,
    write_random_weights,
    write_tiny_model,
)

pytestmark = [pytest.mark.sglang, pytest.mark.live]


def serve(model_dir: Path, *extra: str, dummy: bool = True) -> Iterator[httpx.Client]:
    require_sglang()
    from leyline_agent.backends.sglang.launch import EmbeddedServer

    with (
        EmbeddedServer(
            model_path=model_dir,
            max_total_tokens=4096,
            extra_args=[*(["--dummy"] if dummy else []), *extra],
            env={"LEYLINE_DEBUG_ENDPOINTS": "1"},
        ) as srv,
        httpx.Client(base_url=srv.url, timeout=600) as c,
    ):
        yield c


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_splices_are_exact(family: str, tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / family, family)
    cfg = json.loads((model_dir / "config.json").read_text())
    for c in serve(model_dir):
        amortize = model_check.check_amortize(c)
        assert amortize["kind"] == "mha" and amortize["rope_source"] == "model"
        assert amortize["spec"] == EXPECTED_ROPE[family], amortize["spec"]
        assert amortize["band_max_ulp"] <= 1.0 and amortize["rows_checked"] > 0
        assert amortize["copied"] > 0 and amortize["in_place"]  # both copy paths ran

        # the server's spec (from its rotary modules) agrees with the HF config's
        r = rows(c, seq(4, 1), None)
        served = RopeSpec(**r["rope"]["spec"])
        from_config = RopeSpec.from_hf_config(cfg, pairing=served.pairing)
        assert served.rotary_dim == from_config.rotary_dim
        rel = (inv_freq(served) - inv_freq(from_config)).abs() / inv_freq(from_config)
        assert float(rel.max()) < 1e-5, float(rel.max())

        forget = model_check.check_forget(c)
        assert forget["forget_rows"] > 0
        bad = model_check.check_bad_input(c)
        assert set(bad["bad_input"].values()) <= {400, 422}
        assert_integrity(stats(c))
        print(json.dumps({"family": family, **amortize, **forget}))  # the figures (pytest -s)


def assert_refused_unchanged(c: httpx.Client, reason: str, *, integrity: bool = True) -> None:
    """Cache 200 tokens, then an AMORTIZE and a FORGET splice of them: both 501 naming ``reason``,
    the stats (integrity counters, splice counters) as before, the scheduler alive after SGLang's
    idle check, and the sequence still cached. ``integrity``: also require the counters' identity
    (free + cached + in use == total), which ``/leyline/stats`` computes for page size 1 only."""
    key = ns()
    toks = seq(200, 40)
    gen(c, toks, key)
    st0 = stats(c)
    assert st0["ok"] or not integrity, st0
    for mode in ("amortize", "forget"):
        d = {"start": 40, "end": 90, "replacement": seq(4, 41), "mode": mode}
        r = splice(c, toks, [d], key)
        assert r.status_code == 501, (mode, r.text)
        assert reason in r.json()["error"], r.json()
        print(json.dumps({"mode": mode, "status": r.status_code, **r.json()}))  # pytest -s
    assert stats(c) == st0
    time.sleep(6)  # SGLang's idle check runs while idle; a leak would kill the scheduler
    assert c.get("/health").status_code == 200
    assert gen(c, toks + [5], key)["cached_tokens"] == 200


def test_fp8_kv_cache_splices_by_dequantize_rotate_quantize(tmp_path: Path) -> None:
    """Issue 15's stretch: ``--kv-cache-dtype fp8_e4m3`` (stored as bytes): the band within one
    fp8 ulp of the exact rotation of the stored row, K outside the band and V bit for bit,
    FORGET within one fp8 ulp of a fresh prefill, bad input refused, nothing leaked."""
    model_dir = write_random_weights(write_tiny_model(tmp_path / "qwen3", "qwen3"))
    for c in serve(model_dir, "--kv-cache-dtype", "fp8_e4m3", "--dtype", "bfloat16", dummy=False):
        key, toks = ns(), seq(64, 1)
        gen(c, toks, key)
        r = rows(c, toks, key)
        assert r["cached"] == 64
        assert r["dtype"] == "torch.float8_e4m3fn"
        band = torch.tensor(r["values"][0])[..., :32]
        assert float((band != 0).float().mean()) > 0.9  # real keys, not fp8 zeros
        amortize = model_check.check_amortize(c)
        assert amortize["kind"] == "mha" and amortize["band_max_ulp"] <= 1.0
        assert amortize["rows_checked"] > 0 and amortize["copied"] > 0 and amortize["in_place"]
        forget = model_check.check_forget(c)
        assert forget["forget_rows"] > 0
        bad = model_check.check_bad_input(c)
        assert set(bad["bad_input"].values()) <= {400, 422}
        assert_integrity(stats(c))
        print(json.dumps({"family": "qwen3-fp8_e4m3", **amortize, **forget}))  # pytest -s


def test_sliding_window_model_is_refused_with_501_and_nothing_changes(tmp_path: Path) -> None:
    assert "gemma2-swa" in REFUSED_FAMILIES
    model_dir = write_tiny_model(tmp_path / "gemma2", "gemma2-swa")
    for c in serve(model_dir):
        assert_refused_unchanged(c, "sliding-window")
