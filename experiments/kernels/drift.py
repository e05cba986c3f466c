"""Drift of RoPE keys under composed δ-rotations, and the angle-formation measurement.

Table 1 (drift): K keys with a DeepSeek-V2-Lite rope band (d=64, deepseek_yarn f=40, mscale
≈ 1.37 kept in the stored key) are stored at random positions in bf16 or fp16, then spliced
1000 times: each splice is a δ-rotation by a random Δ (positions kept in [0, 163840)). After
1, 10, 100 and 1000 splices the relative L2 error of the band, ||got - want|| / ||want|| over all
keys, is taken against the exact fp64 rotation of the original key to its final position.
"fp32 math" is the shipped torch reference (`delta_rotation_ref`, called through `delta_rotate`);
"storage math" does the same rotation with cos/sin and products in the storage dtype. The drift
itself is ``leyline_agent.bench.fidelity.drift.drift`` (also part of ``leyline bench fidelity``).

Table 2 (angles): one δ-rotation in fp32 storage, three ways of forming the angle, the numbers
quoted in `leyline_agent.kernels.delta_rotation`.

Prints tables, then one JSON document as the last stdout line. Under a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from rich.console import Console
from rich.table import Table

from leyline_agent.bench.fidelity.drift import CHECKPOINTS, deepseek_v2_lite_spec, drift
from leyline_agent.kernels.delta_rotation_ref import unit_cos_sin
from leyline_agent.kernels.rope import apply_rotation, inv_freq, rotate


def angle_forms(keys: int, seed: int) -> list[dict]:
    """One rotation in fp32 storage: absolute phases vs Δ·θ (fp32) vs Δ·θ (fp64, mod 2π)."""
    spec = deepseek_v2_lite_spec()
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(keys, spec.rotary_dim, generator=gen, dtype=torch.float64)
    theta32 = inv_freq(spec, torch.float32)
    cases = [((0, 4096), (-2048, 2048)), ((100_000, 160_000), (-4096, 4096))]
    cases += [((100_000, 160_000), (-100_000, 0)), ((150_000, 160_000), (-32, 32))]
    rows = []
    for (lo, hi), (dlo, dhi) in cases:
        old = torch.randint(lo, hi, (keys,), generator=gen)
        new = (old + torch.randint(dlo, dhi + 1, (keys,), generator=gen)).clamp(min=0)
        stored = rotate(k, old, spec).float()
        want = rotate(k, new, spec)
        forms = {
            "abs_fp32": new.float()[:, None] * theta32 - old.float()[:, None] * theta32,
            "delta_fp32": (new - old).float()[:, None] * theta32,
        }
        row: dict[str, object] = {"old": [lo, hi], "delta": [dlo, dhi]}
        for name, angle in forms.items():
            got = apply_rotation(stored, angle.cos(), angle.sin(), spec.pairing)
            row[name] = _err_stats(got, want)
        cos, sin = unit_cos_sin(new - old, spec)  # the shipped choice
        row["delta_fp64_mod2pi"] = _err_stats(apply_rotation(stored, cos, sin, spec.pairing), want)
        row["storage_only"] = _err_stats(stored, rotate(k, old, spec))
        rows.append(row)
    return rows


def _err_stats(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    err = (got.double() - want).norm(dim=-1) / want.norm(dim=-1)
    return {"mean": err.mean().item(), "max": err.max().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=1000, choices=CHECKPOINTS)
    parser.add_argument("--max-delta", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="256 keys, 100 splices")
    args = parser.parse_args()
    if args.quick:
        args.keys, args.steps = 256, 100
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    rows = drift(args.keys, args.steps, args.max_delta, args.seed)
    angles = angle_forms(max(args.keys, 4096), args.seed)
    console = Console(width=140)
    table = Table(
        title=f"rope-band rel. L2 error after N splices ({args.keys} keys, |Δ| ≤ {args.max_delta})"
    )
    table.add_column("storage")
    table.add_column("math")
    checkpoints = [0] + [c for c in CHECKPOINTS if c <= args.steps]
    for c in checkpoints:
        table.add_column(f"N={c}", justify="right")
    for row in rows:
        table.add_row(row["dtype"], row["math"], *(f"{row['rel_l2'][c]:.2e}" for c in checkpoints))
    console.print(table)
    table = Table(title="one δ-rotation, fp32 storage: band rel. L2 error (mean / max)")
    for col in ("old pos", "Δ", "new·θ-old·θ fp32", "Δ·θ fp32", "Δ·θ fp64 mod 2π", "storage only"):
        table.add_column(col, justify="right")
    for row in angles:
        cells = [row[k] for k in ("abs_fp32", "delta_fp32", "delta_fp64_mod2pi", "storage_only")]
        table.add_row(
            f"[{row['old'][0]}, {row['old'][1]})",
            f"[{row['delta'][0]}, {row['delta'][1]}]",
            *(f"{c['mean']:.1e} / {c['max']:.1e}" for c in cells),
        )
    console.print(table)
    doc = {
        "experiment": "rope_drift",
        "args": vars(args),
        "drift": rows,
        "angles": angles,
        "seconds": round(time.perf_counter() - t0, 2),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
    }
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
