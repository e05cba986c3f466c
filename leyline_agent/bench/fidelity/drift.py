"""Rope-band drift after 1, 10, 100, 1000 composed splices, against the paper's 4.7e-3.

DeepSeek-V2-Lite's rope band (d = 64, deepseek_yarn f = 40), keys stored at random positions in
bf16 or fp16, each splice a δ-rotation by a random |Δ| ≤ 4096; relative L2 error of the band
against the exact fp64 rotation of the original key to its final position. "fp32" math is the
shipped ``delta_rotate`` (torch implementation), "storage" does cos/sin and products in the
storage dtype. ``experiments/kernels/drift.py`` prints the same measurement with more forms.

    python -m leyline_agent.bench.fidelity.drift [--keys 2048]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from leyline_agent.kernels.delta_rotation import delta_rotate
from leyline_agent.kernels.delta_rotation_ref import unit_cos_sin
from leyline_agent.kernels.rope import RopeBand, RopeSpec, apply_rotation, mscale, rotate

MAX_POS = 163_840
CHECKPOINTS = (1, 10, 100, 1000)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PAPER_BF16_REL_L2 = 4.7e-3


def deepseek_v2_lite_spec() -> RopeSpec:
    config = {
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "max_position_embeddings": MAX_POS,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096},
    }
    return RopeSpec.from_hf_config(config)


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def storage_math_rotate(buf: torch.Tensor, delta: torch.Tensor, spec: RopeSpec) -> None:
    """The naive alternative: cos/sin and products in the storage dtype."""
    cos, sin = unit_cos_sin(delta, spec)
    cos, sin = cos[:, None].to(buf.dtype), sin[:, None].to(buf.dtype)
    buf.copy_(apply_rotation(buf, cos, sin, spec.pairing))


def drift(keys: int, steps: int, max_delta: int, seed: int) -> list[dict]:
    spec = deepseek_v2_lite_spec()
    band = RopeBand(0, spec.rotary_dim)
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(keys, 1, spec.rotary_dim, generator=gen, dtype=torch.float64)
    start = torch.randint(0, MAX_POS, (keys,), generator=gen)
    deltas = torch.randint(-max_delta, max_delta + 1, (steps, keys), generator=gen)
    s = mscale(spec)
    slots = torch.arange(keys)
    rows = []
    for dname, dtype in DTYPES.items():
        for math_name in ("fp32", "storage"):
            buf = (s * rotate(k, start, spec)).to(dtype)
            pos = start.clone()
            errors = {0: rel_l2(buf, s * rotate(k, pos, spec))}
            for step in range(1, steps + 1):
                new = (pos + deltas[step - 1]).clamp(0, MAX_POS - 1)
                if math_name == "fp32":
                    delta_rotate([buf], slots, slots, pos, new, spec, band, impl="torch")
                else:
                    storage_math_rotate(buf, new - pos, spec)
                pos = new
                if step in CHECKPOINTS:
                    errors[step] = rel_l2(buf, s * rotate(k, pos, spec))
            rows.append({"dtype": dname, "math": math_name, "rel_l2": errors})
    return rows


def run(keys: int = 2048, max_delta: int = 4096, seed: int = 0) -> dict[str, Any]:
    t0 = time.perf_counter()
    rows = drift(keys, max(CHECKPOINTS), max_delta, seed)
    for row in rows:
        row["rel_l2"] = {int(k): v for k, v in row["rel_l2"].items()}
    return {
        "experiment": "rope_drift",
        "keys": keys,
        "max_delta": max_delta,
        "checkpoints": [0, *CHECKPOINTS],
        "paper_bf16_rel_l2": PAPER_BF16_REL_L2,
        "rows": rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def rel_l2_at(row: dict[str, Any], n: int) -> float:
    """``row["rel_l2"]`` after ``n`` splices (int keys in memory, str keys once JSON-loaded)."""
    errors = row["rel_l2"]
    return float(errors[n] if n in errors else errors[str(n)])


def table(result: dict[str, Any]) -> str:
    cps = result["checkpoints"]
    lines = [f"{'storage':<8}{'math':<9}" + "".join(f"{'N=' + str(c):>11}" for c in cps)]
    for row in result["rows"]:
        lines.append(
            f"{row['dtype']:<8}{row['math']:<9}"
            + "".join(f"{rel_l2_at(row, c):>11.2e}" for c in cps)
        )
    lines.append(f"paper (bf16): {result['paper_bf16_rel_l2']:.1e} relative L2")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=2048)
    parser.add_argument("--max-delta", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = run(args.keys, args.max_delta, args.seed)
    print(table(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
