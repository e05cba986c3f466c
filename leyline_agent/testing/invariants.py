"""What a live ``leyline serve`` must show: the idle invariants of ``/leyline/stats`` (see
``backends/sglang/integrity.py``) and, after a splice, KV rows moved exactly (MLA: latent
bit-identical, ``k_pe`` within 1 ulp of the exact rotation; MHA/GQA: V and K outside the rope
band bit-identical, K's band within 1 ulp).

Used by the fuzzer (`splice_fuzz`), the model check, the proxy soak and the live tests.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import torch

from leyline_agent.directive import Directive, Mode
from leyline_agent.kernels.rope import RopeSpec, rotate
from leyline_agent.testing.numerics import band_unit


def idle_invariants_hold(st: dict[str, Any]) -> bool:
    return bool(
        st.get("ok")
        and st["duplicate_slots"] == 0
        and st["tree_and_free_list"] == 0
        and st["free"] + st["cached"] == st["total"]
        and st["protected"] == st.get("pinned_slots", 0)  # no lock left but the pins'
        and st["sglang_idle_check"]
    )


def idle_stats(http: httpx.Client, timeout: float = 30.0) -> dict[str, Any]:
    """``/leyline/stats`` once the scheduler is idle (a finished request can stay in the running
    batch for one more scheduler iteration after its answer went out): the cache's counters, so
    without ``control`` (how many control requests were sent, which a refused one changes)."""
    deadline = time.monotonic() + timeout
    while True:
        st = http.get("/leyline/stats").json()
        st.pop("control", None)
        if st.get("idle") or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def check_rows(
    before: dict[str, Any],
    after: dict[str, Any],
    ds: list[Directive],
    lora: int | None = None,
    spec: RopeSpec | None = None,
) -> int:
    """Compare the KV rows of the old (``before``) and spliced (``after``) sequence, both
    ``/leyline/debug/inspect`` rows answers. MLA (rows ``[n, lora + rope]``): the latent ``c_kv``
    bit-identical to its source row, ``k_pe`` within ``numerics.band_unit`` of the exact rotation
    (``kernels.rope.rotate``): 1 ulp of the storage format (bf16 here), or 2^-22 of the row's band
    norm where a component cancels to near zero (the 10,000-op page-16 fuzz stopped at step 6,460
    on a plain 1-ulp bound: 4.86e-9 off a near-zero component). MHA/GQA (K rows ``[n, kv_heads, head_dim]``): V
    and K outside the rope band bit-identical, K's band within the same bound. ``lora``/``spec``:
    the band's offset and the RoPE spec; by default those the server reports (its ``rope``).
    Returns the number of rows checked (rows x layers). Raises ``AssertionError`` naming the first
    bad row."""
    ds = sorted(ds, key=lambda d: d.start)
    forget_at = min((d.start for d in ds if d.mode is Mode.FORGET), default=None)
    rope = before.get("rope") or {}
    if spec is None or lora is None:
        if "spec" not in rope:
            raise AssertionError(f"the server reports no RoPE spec: {rope.get('error', rope)}")
        spec = spec or RopeSpec(**rope["spec"])
    off = lora if lora is not None else int(rope["band"][0])
    dim, dtype = spec.rotary_dim, before.get("dtype", "bfloat16")
    n_old = before["cached"]
    shift, di = 0, 0
    old_idx, new_idx, deltas = [], [], []
    for i in range(n_old):
        while di < len(ds) and ds[di].end <= i:  # an insertion at i shifts i too
            shift += ds[di].delta
            di += 1
        if forget_at is not None and i >= forget_at:
            break
        if any(d.start <= i < d.end for d in ds):
            continue
        j = i + shift
        if j >= after["cached"]:
            break
        old_idx.append(i)
        new_idx.append(j)
        deltas.append(shift)
    if not old_idx:
        return 0
    oi, ni = torch.tensor(old_idx), torch.tensor(new_idx)
    dl = torch.tensor(deltas, dtype=torch.int64)
    name = "k_pe" if before.get("kind", "mla") == "mla" else "K's rope band"
    checked = 0
    for layer in range(len(before["bits"])):
        ob, nb = _heads(before["bits"][layer])[oi], _heads(after["bits"][layer])[ni]
        outside = torch.ones(ob.shape[-1], dtype=torch.bool)
        outside[off : off + dim] = False
        if not torch.equal(ob[..., outside], nb[..., outside]):
            bad = int((ob[..., outside] != nb[..., outside]).flatten(1).any(1).nonzero()[0])
            what = "latent" if name == "k_pe" else "K outside the rope band"
            raise AssertionError(f"layer {layer}: {what} of old row {old_idx[bad]} changed")
        if "v_bits" in before:
            vo = torch.tensor(before["v_bits"][layer])[oi]
            vn = torch.tensor(after["v_bits"][layer])[ni]
            if not torch.equal(vo, vn):
                bad = int((vo != vn).flatten(1).any(1).nonzero()[0])
                raise AssertionError(f"layer {layer}: V of old row {old_idx[bad]} changed")
        ov = _heads(before["values"][layer]).double()[oi][..., off : off + dim]
        nv = _heads(after["values"][layer]).double()[ni][..., off : off + dim]
        exact = rotate(ov, dl, spec)
        err = (nv - exact).abs()
        unit = band_unit(exact, ov, dtype)
        ok = err <= unit + 1e-30
        if not bool(ok.all()):
            bad = int((~ok).flatten(1).any(1).nonzero()[0])
            worst = int((err[bad] - unit[bad]).flatten().argmax())
            raise AssertionError(
                f"layer {layer}: {name} of old row {old_idx[bad]} (shift {deltas[bad]}) is "
                f"{float(err[bad].flatten()[worst]):.3g} from the exact rotation "
                f"{float(exact[bad].flatten()[worst]):.3g} (band norm "
                f"{float(ov[bad].norm(dim=-1).max()):.3g}, unit {float(unit[bad].flatten()[worst]):.3g})"
            )
        checked += len(old_idx)
    return checked


def _heads(t: list[Any]) -> torch.Tensor:
    x = torch.tensor(t)
    return x[:, None, :] if x.dim() == 2 else x  # MLA rows [n, width] -> [n, 1, width]
