"""What a live ``leyline serve`` must show: the idle invariants of ``/leyline/stats`` (see
``backends/sglang/integrity.py``) and, after a splice, KV rows moved exactly (MLA: latent
bit-identical, ``k_pe`` within 1 bf16 ulp of the exact rotation).

Used by the fuzzer (`splice_fuzz`), the model check, the proxy soak and the live tests.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import torch

from leyline_agent.directive import Directive, Mode
from leyline_agent.kernels.rope import RopeSpec, rotate
from leyline_agent.testing.numerics import bf16_ulp


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
    batch for one more scheduler iteration after its answer went out)."""
    deadline = time.monotonic() + timeout
    while True:
        st = http.get("/leyline/stats").json()
        if st.get("idle") or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def check_rows(
    before: dict[str, Any], after: dict[str, Any], ds: list[Directive], lora: int, spec: RopeSpec
) -> int:
    """Compare KV rows of the old (``before``) and spliced (``after``) sequence. Returns the
    number of rows checked. Raises ``AssertionError`` naming the first bad row."""
    ds = sorted(ds, key=lambda d: d.start)
    forget_at = min((d.start for d in ds if d.mode is Mode.FORGET), default=None)
    n_old = before["cached"]
    checked = 0
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
    for layer in range(len(before["bits"])):
        ob, nb = torch.tensor(before["bits"][layer])[oi], torch.tensor(after["bits"][layer])[ni]
        if not torch.equal(ob[:, :lora], nb[:, :lora]):
            bad = int((ob[:, :lora] != nb[:, :lora]).any(1).nonzero()[0])
            raise AssertionError(f"layer {layer}: latent of old row {old_idx[bad]} changed")
        ov = torch.tensor(before["values"][layer], dtype=torch.float64)[oi, lora:]
        nv = torch.tensor(after["values"][layer], dtype=torch.float64)[ni, lora:]
        exact = rotate(ov, dl, spec)
        err = (nv - exact).abs()
        ok = err <= bf16_ulp(exact) + 1e-30
        if not bool(ok.all()):
            bad = int((~ok).any(1).nonzero()[0])
            raise AssertionError(
                f"layer {layer}: k_pe of old row {old_idx[bad]} (shift {deltas[bad]}) is "
                f"{float(err[bad].max()):.3g} from the exact rotation"
            )
        checked += len(old_idx)
    return checked
