"""Which KV pools a splice can edit, and which of their per-layer buffers it rotates or copies.

=====  ==================================  ===========================================  =========
kind   SGLang pool (exact class)            ``rotated`` (band δ-rotated, rest copied)     ``copied``
=====  ==================================  ===========================================  =========
mla    ``MLATokenToKVPool``                 ``kv_buffer[l]`` ``[slots, 1, lora + rope]``  (none)
mha    ``MHATokenToKVPool`` (GQA, MHA)      ``k_buffer[l]`` ``[slots, kv_heads, head_dim]`` ``v_buffer[l]``
=====  ==================================  ===========================================  =========

Everything else is refused with the reason (`UnsupportedKV`): sliding-window and hybrid pools
(``SWAKVPool``, Mamba/linear-attention pools: an edit would have to redo the window or the
recurrent state), subclasses that change the layout or quantize (fp4/mxfp8, page-major, DSA
indexer caches), fp8 KV caches with per-token scale buffers, non-NHD layouts, and models with
sliding-window attention layers.

fp8 KV (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``): SGLang stores ``fp8(k / k_scale)`` as
``uint8`` (``store_dtype``) with one scale per layer. A rotation is linear, so the stored value is
rotated as it is: dequantize to fp32, rotate, quantize (``KVLayout.quant`` names the fp8 dtype;
``splice.py``). Columns outside the band survive the fp32 round trip bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch

from leyline_agent.kernels.rope import RopeBand, RopeSpec

if TYPE_CHECKING:
    from torch import nn

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class UnsupportedKV(ValueError):
    """The served model's KV cache cannot be spliced; the message says why."""


class KVLayout(NamedTuple):
    kind: Literal["mla", "mha"]
    rotated: list[torch.Tensor]
    copied: list[torch.Tensor]
    heads: int
    head_dim: int
    mla_band: RopeBand | None  # MLA: where k_pe sits in a row; MHA: from the RoPE spec
    quant: torch.dtype | None = None  # fp8: the buffers hold its bytes (uint8)

    def band(self, spec: RopeSpec) -> RopeBand:
        """The rope band of one head: MLA's ``k_pe``, MHA's first ``rotary_dim`` columns."""
        band = self.mla_band or RopeBand(0, spec.rotary_dim)
        if band.dim != spec.rotary_dim or band.offset + band.dim > self.head_dim:
            raise UnsupportedKV(
                f"the KV rows ({self.kind}, {self.head_dim} columns per head, band {band}) do not "
                f"match the model's rotary_dim {spec.rotary_dim}"
            )
        return band


def kv_layout(pool: Any) -> KVLayout:
    """Classify ``pool`` (``token_to_kv_pool_allocator.get_kvcache()``) by its exact class.
    Raises `UnsupportedKV`."""
    from leyline_agent.backends.sglang.compat import MHATokenToKVPool, MLATokenToKVPool

    readers: dict[type, Callable[[Any], KVLayout]] = {
        MLATokenToKVPool: _mla_layout,
        MHATokenToKVPool: _mha_layout,
    }
    read = readers.get(type(pool))
    name = type(pool).__name__
    if read is None:
        why = (
            "sliding-window/hybrid attention keeps a second pool whose window a splice would "
            "have to redo"
            if "SWA" in name or "Hybrid" in name or "Mamba" in name
            else "its layout or quantization is not wired in"
        )
        raise UnsupportedKV(
            f"KV pool {name} is not supported ({why}); splices support MLATokenToKVPool "
            "(DeepSeek-V2-style MLA) and MHATokenToKVPool (MHA/GQA)"
        )
    dtype = getattr(pool, "dtype", None)
    store = getattr(pool, "store_dtype", dtype)
    fp8 = dtype in _FP8 and store == torch.uint8
    if fp8 and getattr(pool, "k_scale_buffer", None) is not None:
        raise UnsupportedKV(
            f"KV cache dtype {dtype} with per-token scale buffers is not supported; serve with "
            "--kv-cache-dtype auto, fp8_e4m3 or fp8_e5m2"
        )
    if not fp8 and (dtype not in _DTYPES or store not in _DTYPES):
        raise UnsupportedKV(
            f"KV cache dtype {dtype} (stored as {store}) is not supported; serve with "
            "--kv-cache-dtype auto (bf16/fp16/fp32), fp8_e4m3 or fp8_e5m2"
        )
    return read(pool)._replace(quant=dtype if fp8 else None)


def _mla_layout(pool: Any) -> KVLayout:
    bufs = list(pool.kv_buffer)
    _check_3d(bufs, "kv_buffer")
    band = RopeBand(int(pool.kv_lora_rank), int(pool.qk_rope_head_dim))
    return KVLayout("mla", bufs, [], int(bufs[0].shape[1]), int(bufs[0].shape[2]), band)


def _mha_layout(pool: Any) -> KVLayout:
    layout = getattr(pool, "kv_cache_layout", "nhd")
    if layout != "nhd":
        raise UnsupportedKV(f"KV cache layout {layout!r} is not supported (only 'nhd')")
    k, v = list(pool.k_buffer), list(pool.v_buffer)
    _check_3d(k, "k_buffer")
    _check_3d(v, "v_buffer")
    if len(k) != len(v) or k[0].shape[0] != v[0].shape[0]:
        raise UnsupportedKV("k_buffer and v_buffer disagree on layers or slots")
    return KVLayout("mha", k, v, int(k[0].shape[1]), int(k[0].shape[2]), None)


def _check_3d(bufs: list[torch.Tensor], name: str) -> None:
    if not bufs or any(b.dim() != 3 or not b.is_contiguous() for b in bufs):
        raise UnsupportedKV(f"{name} must be contiguous per-layer [slots, heads, width] tensors")


def check_full_attention(model: nn.Module | None) -> None:
    """Refuse models with sliding-window attention layers (SGLang's ``RadixAttention``)."""
    if model is None:
        return
    from leyline_agent.backends.sglang.compat import RadixAttention

    windows = {
        int(m.sliding_window_size)
        for m in model.modules()
        if isinstance(m, RadixAttention) and (m.sliding_window_size or -1) > 0
    }
    if windows:
        raise UnsupportedKV(
            f"the model has sliding-window attention layers (window {sorted(windows)}): a "
            "splice would move keys across the window edge"
        )
