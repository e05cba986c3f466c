"""Achieved GB/s of the δ-rotation against plain copies of the same bytes.

Cache: a DeepSeek-V2-Lite-like MLA pool, one buffer per layer ``[2·N, 1, 512 + 64]``. Rows:

- ``rotate in place``: `delta_rotate` of N random slots. Bytes = the rope band read + written,
  ``2 · N · layers · 64 · itemsize`` (slot ids and positions, 32 B per slot, not counted).
- ``index_copy band``: the same band bytes gathered and scattered by torch, no math.
- ``rotate + copy rows``: N rows copied to fresh slots with their band rotated. Bytes = whole
  row read + written, ``2 · N · layers · 576 · itemsize``.
- ``index_copy rows``: the same rows copied by ``index_copy_``.
- ``memcpy``: a contiguous copy of the band bytes: the ceiling this machine reaches.

The rotation rows run once per implementation named by ``--impls`` (default: the torch reference
and the Triton kernel on CUDA, the torch reference alone on CPU). On CUDA the device's peak DRAM
bandwidth (``2 · memory_clock_rate · memory_bus_width / 8``) is printed beside the memcpy ceiling.
Prints a table, then one JSON document as the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from leyline_agent.kernels.delta_rotation import Impl, delta_rotate
from leyline_agent.kernels.rope import RopeBand, RopeSpec

KV_LORA_RANK, ROPE_DIM = 512, 64
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def spec_v2_lite() -> RopeSpec:
    config = {
        "kv_lora_rank": KV_LORA_RANK,
        "qk_rope_head_dim": ROPE_DIM,
        "max_position_embeddings": 163840,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096},
    }
    return RopeSpec.from_hf_config(config)


def timed(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_size(
    n: int,
    layers: int,
    dtype: torch.dtype,
    device: torch.device,
    repeats: int,
    impls: Sequence[Impl] = ("auto",),
) -> list[dict]:
    spec, band = spec_v2_lite(), RopeBand(KV_LORA_RANK, ROPE_DIM)
    row = KV_LORA_RANK + ROPE_DIM
    gen = torch.Generator().manual_seed(n)
    buffers = [torch.randn(2 * n, 1, row, device=device).to(dtype) for _ in range(layers)]
    perm = torch.randperm(2 * n, generator=gen).to(device)
    src, fresh = perm[:n].contiguous(), perm[n:].contiguous()
    old_pos = torch.randint(0, 163_840, (n,), generator=gen).to(device)
    new_pos = (old_pos - 1000).clamp(min=0)
    itemsize = buffers[0].element_size()
    band_bytes = 2 * n * layers * ROPE_DIM * itemsize
    row_bytes = 2 * n * layers * row * itemsize
    flat = torch.empty(band_bytes // 2 // itemsize, dtype=dtype, device=device)
    flat_out = torch.empty_like(flat)

    def rotate_in_place(impl: Impl) -> Callable[[], None]:
        return lambda: delta_rotate(buffers, src, src, old_pos, new_pos, spec, band, impl=impl)

    def rotate_copy(impl: Impl) -> Callable[[], None]:
        return lambda: delta_rotate(buffers, src, fresh, old_pos, new_pos, spec, band, impl=impl)

    def copy_band() -> None:
        for buf in buffers:
            rope = buf[..., KV_LORA_RANK:]
            rope.index_copy_(0, src, rope.index_select(0, src))

    def copy_rows() -> None:
        for buf in buffers:
            buf.index_copy_(0, fresh, buf.index_select(0, src))

    cases: list[tuple[str, Impl | None, Callable[[], None], int]] = [
        *(("rotate in place", i, rotate_in_place(i), band_bytes) for i in impls),
        ("index_copy band", None, copy_band, band_bytes),
        *(("rotate + copy rows", i, rotate_copy(i), row_bytes) for i in impls),
        ("index_copy rows", None, copy_rows, row_bytes),
        ("memcpy", None, lambda: flat_out.copy_(flat), band_bytes),
    ]
    results = []
    for name, impl, fn, nbytes in cases:
        seconds = timed(fn, device, repeats)
        results.append(
            {
                "slots": n,
                "op": name,
                "impl": impl,
                "bytes": nbytes,
                "ms": seconds * 1e3,
                "gbps": nbytes / seconds / 1e9,
            }
        )
    return results


def peak_gbps(device: torch.device) -> float | None:
    """The device's peak DRAM bandwidth (double data rate × bus width), None off CUDA."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return 2 * props.memory_clock_rate * 1e3 * props.memory_bus_width / 8 / 1e9


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit() -> str | None:
    """HEAD commit read from .git (no git process), None outside a checkout."""
    git = Path(__file__).resolve().parents[2] / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            ref = head.removeprefix("ref: ")
            loose = git / ref
            if loose.exists():
                return loose.read_text().strip()
            for line in (git / "packed-refs").read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0]
            return None
        return head
    except OSError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default_device)
    parser.add_argument("--quick", action="store_true", help="4k and 32k slots, 2 layers")
    parser.add_argument("--slots", type=int, nargs="+", default=[4096, 32768, 262144])
    parser.add_argument("--layers", type=int, help="default 27 on CUDA, 2 on CPU")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--impls",
        nargs="+",
        choices=("torch", "triton"),
        help="default: both on CUDA, torch on CPU",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    impls = args.impls or (["torch", "triton"] if device.type == "cuda" else ["torch"])
    layers = args.layers or (27 if device.type == "cuda" else 2)
    slots = args.slots
    if args.quick:
        slots, layers, args.repeats = [4096, 32768], 2, 3
    torch.manual_seed(0)
    results = []
    for n in slots:
        results += bench_size(n, layers, DTYPES[args.dtype], device, args.repeats, impls)

    peak = peak_gbps(device)
    table = Table(
        title=f"δ-rotation, {layers} layers × (slots, 1, {KV_LORA_RANK}+{ROPE_DIM}) {args.dtype} "
        f"on {device.type}",
        caption=f"device peak DRAM bandwidth {peak:,.0f} GB/s" if peak else None,
    )
    for col in ("slots", "op", "impl", "MB moved", "ms", "GB/s"):
        table.add_column(col, justify="left" if col in ("op", "impl") else "right")
    for r in results:
        table.add_row(
            str(r["slots"]),
            r["op"],
            r["impl"] or "",
            f"{r['bytes'] / 1e6:.1f}",
            f"{r['ms']:.3f}",
            f"{r['gbps']:.1f}",
        )
    Console(width=120).print(table)
    machine = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "cpu_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "peak_gbps": peak,
    }
    if device.type == "cuda":
        import triton

        machine["triton"] = triton.__version__
    doc = {
        "experiment": "bench_rotation",
        "impls": impls,
        "layers": layers,
        "dtype": args.dtype,
        "results": results,
        "machine": machine,
        "commit": commit(),
    }
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
