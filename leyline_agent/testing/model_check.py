"""Splice mechanics on any served model: the checks (tiny dummy models per family in
`tiny_models`).

Used by ``tests/test_gqa_models.py`` and ``experiments/backend/check_model.py``. The server must
run with ``LEYLINE_DEBUG_ENDPOINTS=1`` (KV rows). Each check raises ``AssertionError`` naming what
broke and returns its measured figures:

- `check_amortize`: two directives (a copied middle, an in-place tail). The next ``/generate``
  finds the whole spliced sequence cached; the rope band of K is within 1 ulp (of the KV storage
  format: bf16, fp8, ...; or, where a component cancels to near zero, 2^-22 of its row's band
  norm: ``numerics.band_unit``) of the exact rotation of the old rows (``kernels.rope.rotate``
  with the spec the server reports); K outside the band and all of V are bit-identical to their
  old rows.
- `check_forget`: FORGET equals a fresh prefill of the new sequence (bf16 tolerance).
- `check_bad_input`: refused with 4xx, rows and ``/leyline/stats`` unchanged.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

import httpx
import torch

from leyline_agent.directive import Directive
from leyline_agent.kernels.rope import RopeSpec, rotate
from leyline_agent.testing.invariants import idle_invariants_hold, idle_stats
from leyline_agent.testing.numerics import band_unit, ulp

# ---- HTTP helpers ------------------------------------------------------------------------------


def _ns() -> str:
    return f"check-{uuid.uuid4().hex[:10]}"


def _seq(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    # NOTE: ids below 40,000: inside every served vocabulary (the embedded 200,064; SmolLM2's
    # 49,152), none of them special; an id past the vocabulary crashes SGLang's embedding
    return [rng.randrange(1000, 40000) for _ in range(n)]


def generate(c: httpx.Client, ids: list[int], key: str | None) -> dict[str, Any]:
    r = c.post(
        "/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "extra_key": key,
        },
    )
    r.raise_for_status()
    return r.json()["meta_info"]


def splice(c: httpx.Client, tokens: list[int], ds: list[dict[str, Any]], key: str | None):
    return c.post("/leyline/splice", json={"tokens": tokens, "directives": ds, "extra_key": key})


def rows(c: httpx.Client, tokens: list[int], key: str | None) -> dict[str, Any]:
    r = c.post("/leyline/debug/inspect", json={"op": "rows", "tokens": tokens, "extra_key": key})
    r.raise_for_status()
    return r.json()


def _apply(tokens: list[int], ds: list[dict[str, Any]]) -> list[int]:
    from leyline_agent.directive import apply_directives

    return apply_directives(tokens, [Directive.model_validate(d) for d in ds])


def _heads(t: list[Any]) -> torch.Tensor:
    x = torch.tensor(t)
    return x[:, None, :] if x.dim() == 2 else x  # MLA rows [n, width] -> [n, 1, width]


def server_rope(r: dict[str, Any]) -> tuple[RopeSpec, tuple[int, int], str]:
    """The spec, band ``(offset, dim)`` and source a rows answer reports."""
    rope = r.get("rope") or {}
    if "spec" not in rope:
        raise AssertionError(f"the server reports no RoPE spec: {rope.get('error', rope)}")
    return RopeSpec(**rope["spec"]), tuple(rope["band"]), rope["source"]


# ---- checks --------------------------------------------------------------------------------


def check_amortize(c: httpx.Client, n: int = 96, seed: int = 1) -> dict[str, Any]:
    """Two AMORTIZE directives; returns rows checked and the band error (ulps, relative)."""
    key = _ns()
    toks = _seq(n, seed)
    generate(c, toks, key)
    before = rows(c, toks, key)
    if before["cached"] != n:
        raise AssertionError(f"only {before['cached']} of {n} tokens cached before the splice")
    spec, (off, dim), source = server_rope(before)
    a, b = n // 5, n // 2
    ds = [
        {"start": a, "end": a + 6, "replacement": _seq(9, seed + 1)},  # delta +3 (middle copied)
        {"start": b, "end": b + 8, "replacement": _seq(3, seed + 2)},  # delta -5, tail in place
    ]
    r = splice(c, toks, ds, key)
    if r.status_code != 200:
        raise AssertionError(f"splice answered {r.status_code}: {r.text}")
    body = r.json()
    new = _apply(toks, ds)
    if body["new_length"] != len(new):
        raise AssertionError(f"new_length {body['new_length']} != {len(new)}")
    cached_next = int(generate(c, new + [4242], key)["cached_tokens"])
    if cached_next != len(new):
        raise AssertionError(f"next /generate found {cached_next} of {len(new)} tokens cached")
    after = rows(c, new, key)
    # (old range, new start, delta) of the kept rows
    d1, d2 = 9 - 6, 3 - 8
    segs = [(range(a + 6, b), a + 6 + d1, d1), (range(b + 8, n), b + 8 + d1 + d2, d1 + d2)]
    worst_ulp, worst_rel, checked = 0.0, 0.0, 0
    for layer in range(len(before["bits"])):
        ob, nb = _heads(before["bits"][layer]), _heads(after["bits"][layer])
        ov = _heads(before["values"][layer]).double()
        nv = _heads(after["values"][layer]).double()
        for old, new_start, delta in segs:
            o = torch.arange(old.start, old.stop)
            j = o + delta
            assert int(j[0]) == new_start
            outside = torch.ones(ob.shape[-1], dtype=torch.bool)
            outside[off : off + dim] = False
            if not torch.equal(ob[o][..., outside], nb[j][..., outside]):
                raise AssertionError(f"layer {layer}: K/latent outside the rope band changed")
            if "v_bits" in before:
                vo = torch.tensor(before["v_bits"][layer])[o]
                vn = torch.tensor(after["v_bits"][layer])[j]
                if not torch.equal(vo, vn):
                    raise AssertionError(f"layer {layer}: V rows changed (delta {delta})")
            exact = rotate(ov[o][..., off : off + dim], torch.full((len(o),), delta), spec)
            got = nv[j][..., off : off + dim]
            err = (got - exact).abs()
            # 1 ulp of the storage format (bf16, fp8, ...), or the fp32 rotation's own rounding
            # where a component cancels to near zero (numerics.band_unit)
            unit = band_unit(exact, ov[o][..., off : off + dim], before["dtype"])
            ulps = err / unit
            if not bool((err <= unit + 1e-30).all()):
                raise AssertionError(
                    f"layer {layer}: rope band {float(ulps.max()):.2f} {before['dtype']} ulps "
                    f"from the exact rotation (delta {delta})"
                )
            worst_ulp = max(worst_ulp, float(ulps.max()))
            rel = float((got - exact).norm() / exact.norm().clamp_min(1e-30))
            worst_rel = max(worst_rel, rel)
            checked += len(o)
    st = idle_stats(c)
    if not idle_invariants_hold(st):
        raise AssertionError(f"integrity after the splice: {st}")
    return {
        "kind": before["kind"],
        "rope_source": source,
        "spec": {k: v for k, v in vars(spec).items() if k in ("rotary_dim", "pairing", "scaling")},
        "rows_checked": checked,
        "in_place": body["in_place"],
        "copied": body["copied"],
        "band_max_ulp": worst_ulp,
        "band_max_rel_l2": worst_rel,
        "cached_after": cached_next,
    }


def check_forget(c: httpx.Client, n: int = 64, seed: int = 5) -> dict[str, Any]:
    """FORGET vs a fresh prefill of the same tokens in another namespace."""
    key, fresh_key = _ns(), _ns()
    toks = _seq(n, seed)
    generate(c, toks, key)
    ds = [{"start": n // 4, "end": n // 4 + 10, "replacement": _seq(3, seed + 1), "mode": "forget"}]
    r = splice(c, toks, ds, key)
    if r.status_code != 200:
        raise AssertionError(f"FORGET answered {r.status_code}: {r.text}")
    new = _apply(toks, ds)
    cached_next = int(generate(c, new + [5], key)["cached_tokens"])
    if cached_next != len(new):
        raise AssertionError(f"after FORGET the next /generate found {cached_next}/{len(new)}")
    spliced = rows(c, new, key)
    generate(c, new, fresh_key)
    fresh = rows(c, new, fresh_key)
    m, worst = compare_to_fresh(spliced, fresh)
    return {"forget_rows": m, "forget_max_abs_diff": worst}


def check_bad_input(c: httpx.Client, seed: int = 9) -> dict[str, Any]:
    """Malformed splices get a 4xx and change neither the rows nor the counters."""
    from leyline_agent.embedded.tokenizer import DEFAULT_VOCAB_SIZE

    key = _ns()
    toks = _seq(40, seed)
    generate(c, toks, key)
    cases = {
        "end_past_sequence": [{"start": 10, "end": 41, "replacement": [5]}],
        "id_ge_vocab": [{"start": 1, "end": 2, "replacement": [DEFAULT_VOCAB_SIZE]}],
        "overlapping": [
            {"start": 1, "end": 5, "replacement": []},
            {"start": 4, "end": 6, "replacement": []},
        ],
        "negative_start": [{"start": -1, "end": 2, "replacement": [5]}],
    }
    statuses = {}
    for name, ds in cases.items():
        before, st0 = rows(c, toks, key), idle_stats(c)
        r = splice(c, toks, ds, key)
        if not 400 <= r.status_code < 500 or not r.json().get("error"):
            raise AssertionError(f"{name}: answered {r.status_code} {r.text}")
        if rows(c, toks, key) != before or idle_stats(c) != st0:
            raise AssertionError(f"{name}: a refused splice changed the cache")
        statuses[name] = r.status_code
    return {"bad_input": statuses}


def run_all(c: httpx.Client) -> dict[str, Any]:
    """Every check in turn; the merged figures (raises on the first failure)."""
    out: dict[str, Any] = {}
    for check in (check_amortize, check_forget, check_bad_input):
        out.update(check(c))
    return out


def compare_to_fresh(spliced: dict[str, Any], fresh: dict[str, Any]) -> tuple[int, float]:
    """Compare a FORGET's KV rows (``rows`` of the debug endpoint: ``values``/``v_values`` per
    layer, ``dtype``) with a fresh prefill's over the tokens both hold.

    Returns:
        (rows compared, the largest absolute difference).

    Raises:
        AssertionError: bf16/fp32 rows more than 2e-2 apart (the two prefills split the attention
        differently), fp8 rows more than one fp8 ulp apart.
    """
    m = min(spliced["cached"], fresh["cached"])
    worst = 0.0
    for field in ("values", "v_values"):
        for layer in range(len(spliced.get(field, []))):
            x = torch.tensor(spliced[field][layer])[:m]
            y = torch.tensor(fresh[field][layer])[:m]
            # the two prefills split the attention differently (prefix cached or not): bf16
            # storage may round them apart by 2e-2; fp8 by one of its ulps
            if "float8" in spliced["dtype"]:
                unit = ulp(torch.maximum(x.abs(), y.abs()), spliced["dtype"])
                bad = (x - y).abs() > unit + 1e-6
                if bool(bad.any()):
                    raise AssertionError(f"FORGET != fresh prefill by more than 1 ulp: {field}")
            else:
                torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-2)
            worst = max(worst, float((x - y).abs().max()))
    return m, worst
