"""Extend attention on CPU: ``torch_native`` (queries padded to the whole sequence) vs
``leyline_cpu`` (the new tokens' queries only), one layer call.

Shapes are the embedded model's absorbed MLA layer: 4 query heads, 1 KV head, q/k width 80
(kv_lora_rank 64 + rope 16), v width 64, bf16. One request with ``L - new`` cached tokens and
``new`` new ones; the KV slots are scattered over the pool as a served request's would be.

    .venv/bin/python experiments/backend/bench_cpu_attention.py [--lengths 1024 4096 8192] [--threads 1]

The last stdout line is JSON: per length, each backend's best time in seconds over ``--repeats`` calls, the speed-up and
the largest absolute difference between their outputs.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from types import SimpleNamespace

import torch

Q_HEADS, KV_HEADS, QK_DIM, V_DIM = 4, 1, 80, 64


def bench(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)  # best of N: the machine is shared, so slower runs measure the neighbours


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--new", type=int, default=8, help="new (extend) tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: torch's default; 1 is steadier "
        "on a busy machine, where OpenMP threads wait on each other)",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from leyline_agent.backends.sglang.attention import LeylineCpuAttnBackend

    runner = SimpleNamespace(device="cpu", req_to_token_pool=None, token_to_kv_pool=None)
    backends = {
        "torch_native": TorchNativeAttnBackend(runner),
        "leyline_cpu": LeylineCpuAttnBackend(runner),
    }
    torch.manual_seed(0)
    dtype = torch.bfloat16
    results = []
    for length in args.lengths:
        # MLA pool layout: one buffer [slots, 1, 80]; v is a view of its first 64 columns.
        kv = torch.randn(length + 1, KV_HEADS, QK_DIM).to(dtype)
        req_to_token = (torch.randperm(length) + 1).to(torch.int32).unsqueeze(0)
        query = torch.randn(args.new, Q_HEADS, QK_DIM).to(dtype)
        call = dict(
            k_cache=kv,
            v_cache=kv[..., :V_DIM],
            req_to_token=req_to_token,
            req_pool_indices=torch.tensor([0]),
            seq_lens=torch.tensor([length]),
            extend_prefix_lens=torch.tensor([length - args.new]),
            extend_seq_lens=torch.tensor([args.new]),
            scaling=QK_DIM**-0.5,
            enable_gqa=True,
            causal=True,
        )
        row: dict[str, float | int] = {"L": length, "new": args.new}
        outs = {}
        for name, backend in backends.items():
            out = torch.empty(args.new, Q_HEADS, V_DIM, dtype=dtype)
            run = functools.partial(backend._run_sdpa_forward_extend, query, out, **call)
            row[f"{name}_s"] = round(bench(run, args.repeats), 4)
            outs[name] = out.float()
        row["speedup"] = round(row["torch_native_s"] / row["leyline_cpu_s"], 1)
        row["max_abs_diff"] = float((outs["torch_native"] - outs["leyline_cpu"]).abs().max())
        print(
            f"L={length:5d} new={args.new}: torch_native {row['torch_native_s']:.4f} s, "
            f"leyline_cpu {row['leyline_cpu_s']:.4f} s, x{row['speedup']}, "
            f"max |diff| {row['max_abs_diff']:.2e}",
            flush=True,
        )
        results.append(row)
    print(
        json.dumps(
            {
                "dtype": "bfloat16",
                "shape": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "qk": QK_DIM, "v": V_DIM},
                "threads": torch.get_num_threads(),
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
