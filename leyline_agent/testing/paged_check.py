"""Splice checks on a paged KV pool (``--page-size`` > 1), for MLA and MHA/GQA servers.

Used by ``tests/test_paged_splice.py``. The server runs with ``LEYLINE_DEBUG_ENDPOINTS=1`` (KV
rows). A paged tree holds full pages only, so a cached sequence of ``n`` tokens holds
``n // page · page`` of them; every check below compares what the tree holds. Each raises
``AssertionError`` naming what broke and returns its figures:

- `check_layout`: the held slots keep ``slot % page == position % page``, one page per
  ``page`` positions (what SGLang's paged attention backends read).
- `check_rows`: after a splice, every kept row the tree holds: outside the rope band (MLA's latent,
  K's other dims) and V bit-identical to its old row, the band within 1 ulp of the storage format
  of the exact rotation (``kernels.rope.rotate``, with the spec the server reports).
- `check_splice`: cache, splice, the next request's cached tokens, layout, rows, integrity.
- `check_forget`: FORGET equals a fresh prefill (bf16 tolerance, as ``model_check``).
"""

from __future__ import annotations

from typing import Any

import httpx
import torch

from leyline_agent.directive import Directive, Mode, apply_directives
from leyline_agent.kernels.rope import rotate
from leyline_agent.testing.invariants import idle_invariants_hold, idle_stats
from leyline_agent.testing.model_check import (
    _heads,
    _ns,
    _seq,
    compare_to_fresh,
    generate,
    rows,
    server_rope,
    splice,
)
from leyline_agent.testing.numerics import band_unit


def check_layout(r: dict[str, Any], page: int) -> None:
    """Slots of a rows answer: page-contiguous, ``slot % page == position % page``."""
    slots = torch.tensor(r["slots"], dtype=torch.int64)
    if not slots.numel():
        return
    pos = torch.arange(slots.numel())
    if not bool((slots % page == pos % page).all()):
        raise AssertionError(f"slots off their page offsets: {slots.tolist()[: 3 * page]}")
    if not bool((slots // page == (slots[pos // page * page] // page)).all()):
        raise AssertionError("a page of positions spans two physical pages")


def kept_rows(n_old: int, ds: list[Directive]) -> tuple[list[int], list[int], list[int]]:
    """Old positions below ``n_old`` that an edit keeps, their new positions and shifts (none
    from the first FORGET on)."""
    ds = sorted(ds, key=lambda d: d.start)
    forget_at = min((d.start for d in ds if d.mode is Mode.FORGET), default=n_old)
    old, new, shifts = [], [], []
    shift, di = 0, 0
    for i in range(min(n_old, forget_at)):
        while di < len(ds) and ds[di].end <= i:
            shift += ds[di].delta
            di += 1
        if any(d.start <= i < d.end for d in ds):
            continue
        old.append(i)
        new.append(i + shift)
        shifts.append(shift)
    return old, new, shifts


def check_rows(before: dict[str, Any], after: dict[str, Any], ds: list[Directive]) -> dict:
    """Compare the rows of the old (``before``) and spliced (``after``) sequence where the tree
    holds both. Returns rows checked and the worst band error in ulps."""
    spec, (off, dim), _ = server_rope(before)
    old, new, shifts = kept_rows(before["cached"], ds)
    keep = [k for k, j in enumerate(new) if j < after["cached"]]
    if not keep:
        return {"rows_checked": 0, "band_max_ulp": 0.0}
    o = torch.tensor([old[k] for k in keep])
    j = torch.tensor([new[k] for k in keep])
    delta = torch.tensor([shifts[k] for k in keep], dtype=torch.int64)
    worst = 0.0
    for layer in range(len(before["bits"])):
        ob, nb = _heads(before["bits"][layer])[o], _heads(after["bits"][layer])[j]
        outside = torch.ones(ob.shape[-1], dtype=torch.bool)
        outside[off : off + dim] = False
        if not torch.equal(ob[..., outside], nb[..., outside]):
            raise AssertionError(f"layer {layer}: K/latent outside the rope band changed")
        if "v_bits" in before:
            vo, vn = (
                torch.tensor(before["v_bits"][layer])[o],
                torch.tensor(after["v_bits"][layer])[j],
            )
            if not torch.equal(vo, vn):
                raise AssertionError(f"layer {layer}: V rows changed")
        ov = _heads(before["values"][layer]).double()[o][..., off : off + dim]
        got = _heads(after["values"][layer]).double()[j][..., off : off + dim]
        exact = rotate(ov, delta, spec)
        unit = band_unit(exact, ov, before["dtype"])  # 1 ulp, or the fp32 rotation's rounding
        err = (got - exact).abs()
        if not bool((err <= unit + 1e-30).all()):
            bad = int((err > unit + 1e-30).flatten(1).any(1).nonzero()[0])
            raise AssertionError(
                f"layer {layer}: rope band of old row {int(o[bad])} (shift {int(delta[bad])}) "
                f"{float((err / unit)[bad].max()):.2f} ulps from the exact rotation"
            )
        worst = max(worst, float((err / unit).max()))
    return {"rows_checked": len(keep) * len(before["bits"]), "band_max_ulp": worst}


def check_splice(
    c: httpx.Client, page: int, n: int, ds: list[dict[str, Any]], seed: int = 1
) -> dict[str, Any]:
    """Cache ``n`` tokens, splice them with ``ds`` (ending inside the held pages), check the
    next request's cache hit, the layout, the rows and the integrity counters."""
    key, toks = _ns(), _seq(n, seed)
    generate(c, toks, key)
    before = rows(c, toks, key)
    if before["cached"] != n // page * page:
        raise AssertionError(f"{before['cached']} of {n} tokens cached on {page}-token pages")
    r = splice(c, toks, ds, key)
    if r.status_code != 200:
        raise AssertionError(f"splice answered {r.status_code}: {r.text}")
    body = r.json()
    directives = [Directive.model_validate(d) for d in ds]
    new = apply_directives(toks, directives)
    if body["new_length"] != len(new):
        raise AssertionError(f"new_length {body['new_length']} != {len(new)}")
    # the tree held n // page pages; the uncached partial page stays out of the splice
    held = (len(new) - (n - before["cached"])) // page * page
    after = rows(c, new, key)
    if after["cached"] != held:
        raise AssertionError(f"{after['cached']} of the spliced {len(new)} tokens held")
    check_layout(after, page)
    figures = check_rows(before, after, directives)
    cached_next = int(generate(c, new + [4242], key)["cached_tokens"])
    if cached_next != held:
        raise AssertionError(f"next /generate found {cached_next} of {held} held tokens cached")
    st = idle_stats(c)
    if not idle_invariants_hold(st):
        raise AssertionError(f"integrity after the splice: {st}")
    keys = ("in_place", "copied", "rotated", "prefilled", "prefix_reused")
    return {**figures, **{k: body[k] for k in keys}, "held_after": held}


def check_forget(
    c: httpx.Client, page: int, n: int, d: dict[str, Any], seed: int = 5
) -> dict[str, Any]:
    """A FORGET directive ``d`` vs a fresh prefill of the edited tokens in another namespace."""
    key, fresh_key = _ns(), _ns()
    toks = _seq(n, seed)
    generate(c, toks, key)
    r = splice(c, toks, [{**d, "mode": "forget"}], key)
    if r.status_code != 200:
        raise AssertionError(f"FORGET answered {r.status_code}: {r.text}")
    new = apply_directives(toks, [Directive.model_validate({**d, "mode": "forget"})])
    spliced = rows(c, new, key)
    if spliced["cached"] != (len(new) - n % page) // page * page:  # the held pages' edit
        raise AssertionError(f"after FORGET {spliced['cached']} of {len(new)} tokens held")
    check_layout(spliced, page)
    generate(c, new, fresh_key)
    fresh = rows(c, new, fresh_key)
    m, worst = compare_to_fresh(spliced, fresh)
    st = idle_stats(c)
    if not idle_invariants_hold(st):
        raise AssertionError(f"integrity after FORGET: {st}")
    return {"forget_rows": m, "forget_max_abs_diff": worst, "purged": r.json()["purged"]}


def check_bad_input(c: httpx.Client, page: int, seed: int = 9) -> dict[str, int]:
    """Malformed splices of ``2·page + 7`` cached tokens: a 4xx each, rows and counters as
    before. Returns the status per case."""
    from leyline_agent.embedded.tokenizer import DEFAULT_VOCAB_SIZE

    key, n = _ns(), 2 * page + 7
    toks = _seq(n, seed)
    generate(c, toks, key)
    cases = {
        "end_past_sequence": [{"start": page + 1, "end": n + 1, "replacement": [5]}],
        "id_ge_vocab": [{"start": page + 1, "end": page + 2, "replacement": [DEFAULT_VOCAB_SIZE]}],
        "overlapping": [
            {"start": 1, "end": page + 2, "replacement": []},
            {"start": page, "end": page + 3, "replacement": []},
        ],
        "negative_start": [{"start": -1, "end": 2, "replacement": [5]}],
    }
    statuses = {}
    for name, ds in cases.items():
        before, st0 = rows(c, toks, key), idle_stats(c)
        if before["cached"] != 2 * page:
            raise AssertionError(f"{name}: {before['cached']} of {n} tokens held before")
        r = splice(c, toks, ds, key)
        if not 400 <= r.status_code < 500 or not r.json().get("error"):
            raise AssertionError(f"{name}: answered {r.status_code} {r.text}")
        if rows(c, toks, key) != before or idle_stats(c) != st0:
            raise AssertionError(f"{name}: a refused splice changed the cache")
        statuses[name] = r.status_code
    return statuses
