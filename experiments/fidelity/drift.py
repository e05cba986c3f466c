"""Rope-band drift after 1, 10, 100, 1000 composed splices, against the paper's 4.7e-3.

Reuses ``experiments/kernels/drift.py`` (DeepSeek-V2-Lite rope band: d = 64, deepseek_yarn
f = 40, keys stored at random positions in bf16 or fp16, each splice a δ-rotation by a random
|Δ| ≤ 4096; relative L2 error of the band against the exact fp64 rotation of the original key to
its final position; "fp32" math is the shipped ``delta_rotate_torch``, "storage" does cos/sin and
products in the storage dtype).

    python -m experiments.fidelity.drift [--keys 2048]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from experiments.kernels.drift import CHECKPOINTS, drift

PAPER_BF16_REL_L2 = 4.7e-3


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
