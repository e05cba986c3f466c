"""Triton δ-rotation kernel (`delta_rotate_triton`); contract and angle choice in `delta_rotation`.

Takes arguments already validated by `delta_rotation.check_inputs` (and imports nothing from that
module). On CPU it runs only under ``TRITON_INTERPRET=1`` set before this module is imported.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from leyline_agent.kernels.delta_rotation_ref import Rotation
from leyline_agent.kernels.rope import RopeBand, RopeSpec, inv_freq

# Tensors (all int64 element offsets; buffers contiguous, shared shape/dtype):
#   layer_ptrs [L] int64        data_ptr() of each layer buffer [S, H, W], strides (H·W, W, 1)
#   src, dst   [N] int64        slot ids (row of every layer), stride 1
#   delta      [N] int64        new_pos - old_pos, stride 1
#   turns      [P] float64      inv_freq / 2π (turns per position), P = rotary_dim / 2, stride 1
# Band pair p of head h: columns a = OFF + 2p, b = a + 1 (interleaved) or a = OFF + p, b = a + P.
# Math: φ = 2π·frac(Δ·turns_p) (fp64 frac -> fp32); (a, b) <- (a·cos φ - b·sin φ, b·cos φ + a·sin φ).
# Grid (cdiv(N, BLOCK_N), layer groups); a program forms cos/sin once and loops its layers.


@triton.jit
def _delta_rotate_kernel(
    layer_ptrs,
    src_ptr,
    dst_ptr,
    delta_ptr,
    turns_ptr,
    N,
    L,
    layers_per_prog,
    H,
    W,
    OFF,
    P,
    DTYPE: tl.constexpr,
    BITS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    COPY: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_HP: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid_n = tl.program_id(0).to(tl.int64)
    pid_l = tl.program_id(1).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    n_ok = n < N
    src = tl.load(src_ptr + n, mask=n_ok, other=0)
    dst = tl.load(dst_ptr + n, mask=n_ok, other=0)
    delta = tl.load(delta_ptr + n, mask=n_ok, other=0)

    hp = tl.arange(0, BLOCK_HP).to(tl.int64)
    hp_ok = hp < H * P
    h = hp // P
    p = hp % P
    turns = delta.to(tl.float64)[:, None] * tl.load(turns_ptr + p, mask=hp_ok, other=0.0)[None, :]
    phi = (turns - tl.floor(turns + 0.5)).to(tl.float32) * 6.283185307179586
    cos = tl.cos(phi)
    sin = tl.sin(phi)

    if INTERLEAVED:
        col_a = h * W + OFF + 2 * p
        col_b = col_a + 1
    else:
        col_a = h * W + OFF + p
        col_b = col_a + P
    row_w = H * W
    src_a = src[:, None] * row_w + col_a[None, :]
    src_b = src[:, None] * row_w + col_b[None, :]
    dst_a = dst[:, None] * row_w + col_a[None, :]
    dst_b = dst[:, None] * row_w + col_b[None, :]
    ok = n_ok[:, None] & hp_ok[None, :]
    moved = n_ok & (src != dst)

    l_start = pid_l * layers_per_prog
    l_end = tl.minimum(l_start + layers_per_prog, L)
    for layer in range(l_start, l_end):
        addr = tl.load(layer_ptrs + layer)
        buf = addr.to(tl.pointer_type(DTYPE))
        a = tl.load(buf + src_a, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(buf + src_b, mask=ok, other=0.0).to(tl.float32)
        tl.store(buf + dst_a, (a * cos - b * sin).to(DTYPE), mask=ok)
        tl.store(buf + dst_b, (b * cos + a * sin).to(DTYPE), mask=ok)
        if COPY:
            # Raw bits (integer view): the non-band columns of a copied row stay bit-identical.
            bits = addr.to(tl.pointer_type(BITS))
            for c0 in range(0, row_w, BLOCK_C):
                c = c0 + tl.arange(0, BLOCK_C).to(tl.int64)
                in_w = c % W
                keep = (c < row_w) & ((in_w < OFF) | (in_w >= OFF + 2 * P))
                m = moved[:, None] & keep[None, :]
                v = tl.load(bits + src[:, None] * row_w + c[None, :], mask=m, other=0)
                tl.store(bits + dst[:, None] * row_w + c[None, :], v, mask=m)


_TL_DTYPES = {
    torch.float32: (tl.float32, tl.int32),
    torch.float16: (tl.float16, tl.int16),
    torch.bfloat16: (tl.bfloat16, tl.int16),
}


def delta_rotate_triton(
    buffers: Sequence[torch.Tensor],
    rot: Rotation,
    spec: RopeSpec,
    band: RopeBand,
    *,
    copies: bool,
    programs: int = 1024,
) -> None:
    """`delta_rotation.delta_rotate` in one launch on validated arguments; ``copies``: some
    ``src != dst`` (what `check_inputs` returns). ``programs`` is the grid size aimed at when
    splitting layers into groups."""
    src, dst, old_pos, new_pos = rot
    device = buffers[0].device
    interpreted = not isinstance(_delta_rotate_kernel, triton.runtime.JITFunction)
    if device.type == "cpu" and not (interpreted and triton.knobs.runtime.interpret):
        raise ValueError(
            "Triton on CPU buffers needs TRITON_INTERPRET=1, set before importing "
            "leyline_agent.kernels.delta_rotation_triton and while calling; else use impl='torch'"
        )
    if device.type != "cpu" and interpreted:
        raise ValueError("TRITON_INTERPRET=1 was set at import: the kernel cannot run on a GPU")
    n = src.numel()
    if n == 0:
        return
    _, heads, row = buffers[0].shape
    pairs = spec.rotary_dim // 2
    num_layers = len(buffers)
    layer_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=device)
    turns = inv_freq(spec, device=device) / (2 * math.pi)
    block_hp = triton.next_power_of_2(heads * pairs)
    block_n = max(1, min(triton.next_power_of_2(n), 1024 // block_hp))
    block_c = max(16, min(triton.next_power_of_2(heads * row), 4096 // block_n))
    n_blocks = triton.cdiv(n, block_n)
    # Split layers into groups only as far as needed to reach `programs` programs: each
    # program forms cos/sin once and reuses them for all heads and layers of its group.
    groups = min(num_layers, max(1, triton.cdiv(programs, n_blocks)))
    layers_per_prog = triton.cdiv(num_layers, groups)
    groups = triton.cdiv(num_layers, layers_per_prog)
    dtype, bits = _TL_DTYPES[buffers[0].dtype]
    _delta_rotate_kernel[(n_blocks, groups)](
        layer_ptrs,
        src.contiguous(),
        dst.contiguous(),
        (new_pos - old_pos).contiguous(),
        turns,
        n,
        num_layers,
        layers_per_prog,
        heads,
        row,
        band.offset,
        pairs,
        DTYPE=dtype,
        BITS=bits,
        INTERLEAVED=spec.pairing == "interleaved",
        COPY=copies,
        BLOCK_N=block_n,
        BLOCK_HP=block_hp,
        BLOCK_C=block_c,
    )
