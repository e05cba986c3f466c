"""δ-rotation: move stored RoPE keys to new positions in place of a re-prefill.

A cached key at position ``i`` holds ``s · R(i) k`` in its rope band (``s`` = YaRN's mscale).
Since ``R(j) = R(j - i) R(i)``, rotating the band by ``Δ = j - i`` with UNIT cos/sin gives
``s · R(j) k`` exactly; ``s`` and every column outside the band (MLA's latent ``c_kv``) stay as
they are, bit for bit.

Buffers (one per layer, same shape/dtype/device, contiguous), SGLang layout::

    MLA      MLATokenToKVPool.kv_buffer[layer]  [num_slots, 1, kv_lora_rank + qk_rope_head_dim]
             band = RopeBand(kv_lora_rank, qk_rope_head_dim)
    MHA/GQA  MHATokenToKVPool.k_buffer[layer]   [num_slots, heads, head_dim]
             band = RopeBand(0, rotary_dim) (rotary first) or RopeBand(head_dim - d, d)
             MHATokenToKVPool.v_buffer[layer]   [num_slots, heads, v_head_dim]
             copy_buffers: rows copied bit for bit with their K rows, never rotated

Angles. Three ways to form the angle of pair ``p`` were measured against the fp64 oracle
(`rope.rotate` of the original key straight to the new position), fp32 storage so that storage
rounding does not hide the math, DeepSeek-V2-Lite rope (d=64, deepseek_yarn f=40), 4096 keys,
relative L2 error of the band, mean / max (``experiments/kernels/drift.py``, table 2)::

    old pos        Δ              new·θ - old·θ (fp32)   Δ·θ (fp32)          Δ·θ (fp64, mod 2π)
    [0, 4k)        ±2k            1.5e-05 / 8.8e-05      5.0e-06 / 2.6e-05   7.9e-08 / 1.5e-07
    [100k, 160k)   ±4k            8.2e-04 / 3.1e-03      1.1e-05 / 6.1e-05   8.0e-08 / 1.6e-07
    [100k, 160k)   [-100k, 0]     7.5e-04 / 2.7e-03      2.7e-04 / 1.7e-03   8.5e-08 / 1.5e-07
    [150k, 160k)   ±32            9.4e-04 / 2.8e-03      1.0e-07 / 4.5e-07   6.3e-08 / 1.3e-07

Absolute phases lose ``ulp(pos · θ)`` ≈ 1e-2 rad at 160k; ``Δ·θ`` in fp32 loses ``ulp(Δ · θ)``.
We form ``Δ · inv_freq / 2π`` (turns) in fp64, keep its fraction in [-1/2, 1/2] and only then go
to fp32 (``φ = 2π · frac``): the error is then the fp32 floor (storage rounding alone is
2.5e-08) whatever Δ and the position, for a few fp64 operations per (slot, pair), shared by all
heads and layers. The rotation itself is fp32 math whatever the storage dtype (fp32, fp16,
bf16), rounded once to the storage dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from leyline_agent.kernels.delta_rotation_ref import Rotation, delta_rotate_torch
from leyline_agent.kernels.rope import RopeBand, RopeSpec

if TYPE_CHECKING:
    import torch

__all__ = ["Impl", "Rotation", "check_copy_buffers", "check_inputs", "delta_rotate"]

Impl = Literal["auto", "torch", "triton"]


def delta_rotate(
    buffers: Sequence[torch.Tensor],
    src: torch.Tensor,
    dst: torch.Tensor,
    old_pos: torch.Tensor,
    new_pos: torch.Tensor,
    spec: RopeSpec,
    band: RopeBand,
    impl: Impl = "auto",
    copy_buffers: Sequence[torch.Tensor] = (),
) -> None:
    """Rotate the rope band of rows ``src`` from ``old_pos`` to ``new_pos`` into rows ``dst``.

    Args:
        buffers: per-layer caches ``[num_slots, heads, row]``, fp32/fp16/bf16, contiguous, one
            dtype/shape/device (see module docstring for the layouts).
        src, dst: int64 ``[N]`` slot ids. ``dst[i] == src[i]`` rotates in place; otherwise the
            whole row is copied (non-band columns bit-identical) and its band rotated. ``dst``
            must be unique and must not hit a row that another entry reads.
        old_pos, new_pos: int64 ``[N]`` absolute positions, ``>= 0``.
        spec, band: the model's rotation and where its band sits in a row (``band.dim ==
            spec.rotary_dim``).
        impl: "auto" (Triton on CUDA, torch otherwise), "torch" (`delta_rotation_ref`) or
            "triton" (`delta_rotation_triton`).
        copy_buffers: per-layer caches whose rows travel with the rotated rows but are never
            rotated (an MHA pool's ``v_buffer``): row ``src[i]`` is copied to ``dst[i]`` bit for
            bit where they differ. Any shape ``[num_slots, ...]`` and dtype, on the same device.

    Only the band of ``dst`` rows is rewritten. Raises ``ValueError`` (``TypeError`` for
    non-tensors) with what to fix; nothing is written then.
    """
    check_copy_buffers(copy_buffers, buffers)
    if impl == "auto":
        first = buffers[0] if isinstance(buffers, Sequence) and len(buffers) else None
        impl = "triton" if getattr(first, "is_cuda", False) else "torch"
    if impl not in ("torch", "triton"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    rot = Rotation(src, dst, old_pos, new_pos)
    if impl == "triton":
        from leyline_agent.kernels.delta_rotation_triton import delta_rotate_triton

        delta_rotate_triton(buffers, rot, spec, band, copies=check_inputs(buffers, rot, spec, band))
    else:
        delta_rotate_torch(buffers, rot, spec, band, copies=check_inputs(buffers, rot, spec, band))
    if copy_buffers and src.numel():
        moved = src != dst
        s, d = src[moved], dst[moved]
        for buf in copy_buffers:
            buf.index_copy_(0, d, buf.index_select(0, s))


def check_copy_buffers(
    copy_buffers: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]
) -> None:
    """Validate `delta_rotate`'s ``copy_buffers`` against the rotated ``buffers``."""
    import torch

    if isinstance(copy_buffers, torch.Tensor) or not isinstance(copy_buffers, Sequence):
        raise TypeError("copy_buffers must be a sequence of per-layer tensors")
    if not copy_buffers:
        return
    first = buffers[0] if isinstance(buffers, Sequence) and len(buffers) else None
    if not isinstance(first, torch.Tensor):
        raise TypeError("buffers must be a non-empty sequence of per-layer tensors")
    for i, buf in enumerate(copy_buffers):
        if not isinstance(buf, torch.Tensor):
            raise TypeError(f"copy_buffers[{i}] is {type(buf).__name__}, not a tensor")
        if buf.dim() < 1 or buf.shape[0] != first.shape[0] or buf.device != first.device:
            raise ValueError(
                f"copy_buffers[{i}] is {tuple(buf.shape)} on {buf.device}: it needs the "
                f"{first.shape[0]} slots of buffers[0] on {first.device}"
            )


_DTYPES = ("float32", "float16", "bfloat16")


def check_inputs(
    buffers: Sequence[torch.Tensor], rot: Rotation, spec: RopeSpec, band: RopeBand
) -> bool:
    """Validate `delta_rotate` arguments; return whether any row is copied (``src != dst``).

    One host sync for the value checks (index ranges, positions, write hazards).
    """
    import torch

    src, dst, old_pos, new_pos = rot
    if isinstance(buffers, torch.Tensor) or not isinstance(buffers, Sequence) or not buffers:
        raise TypeError("buffers must be a non-empty sequence of per-layer tensors")
    first = buffers[0]
    for i, buf in enumerate(buffers):
        if not isinstance(buf, torch.Tensor):
            raise TypeError(f"buffers[{i}] is {type(buf).__name__}, not a tensor")
        if buf.dim() != 3:
            raise ValueError(
                f"buffers[{i}] must be [num_slots, heads, row], got {tuple(buf.shape)}"
            )
        if (buf.shape, buf.dtype, buf.device) != (first.shape, first.dtype, first.device):
            raise ValueError(
                f"buffers[{i}] is {tuple(buf.shape)} {buf.dtype} on {buf.device}; buffers[0] is "
                f"{tuple(first.shape)} {first.dtype} on {first.device}: all layers must match"
            )
        if not buf.is_contiguous():
            raise ValueError(f"buffers[{i}] must be contiguous (stride {buf.stride()})")
    if str(first.dtype).removeprefix("torch.") not in _DTYPES:
        raise ValueError(f"buffer dtype {first.dtype} not supported: use one of {_DTYPES}")
    num_slots, _, row = first.shape
    if band.dim != spec.rotary_dim:
        raise ValueError(f"band.dim {band.dim} != spec.rotary_dim {spec.rotary_dim}")
    if band.offset < 0 or band.offset + band.dim > row:
        raise ValueError(f"band {band} does not fit in a row of {row} columns")
    n = None
    for name, t in (("src", src), ("dst", dst), ("old_pos", old_pos), ("new_pos", new_pos)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int64 or t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D int64 tensor, got {t.dtype} {tuple(t.shape)}")
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device}, buffers on {first.device}")
        n = t.numel() if n is None else n
        if t.numel() != n:
            raise ValueError(
                f"src, dst, old_pos, new_pos must have one length; {name} has {t.numel()}"
            )
    if n == 0:
        return False
    moved = src != dst
    dst_sorted = dst.sort().values
    # NOTE: a row read by entry j must not be written by entry i != j (programs run in any order).
    flags = torch.stack(
        [
            (src.min() < 0) | (src.max() >= num_slots),
            (dst.min() < 0) | (dst.max() >= num_slots),
            new_pos.min() < 0,
            old_pos.min() < 0,
            (dst_sorted[1:] == dst_sorted[:-1]).any(),
            (torch.isin(src, dst) & moved).any(),
            moved.any(),
        ]
    ).tolist()
    bad_src, bad_dst, neg_new, neg_old, dup_dst, hazard, copies = flags
    if bad_src or bad_dst:
        which = "src" if bad_src else "dst"
        raise ValueError(f"{which} slot ids must lie in [0, {num_slots})")
    if neg_new:
        raise ValueError("new_pos has negative positions: a key cannot move before position 0")
    if neg_old:
        raise ValueError("old_pos has negative positions")
    if dup_dst:
        raise ValueError("dst has repeated slot ids: each destination row is written once")
    if hazard:
        raise ValueError(
            "a copied entry reads a row that another entry writes (src[j] in dst with "
            "src[j] != dst[j]): rotate in place or copy to fresh slots"
        )
    return bool(copies)
