"""Tolerances the KV checks share (tests, fuzzer, model check, fidelity architectures)."""

from __future__ import annotations

import torch


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at ``|x|`` (8 significant bits), same shape and dtype as ``x``."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


# significant bits after the leading one, and the smallest normal exponent, per storage format
_FORMATS = {
    "bfloat16": (7, -126),
    "float16": (10, -14),
    "float32": (23, -126),
    "float8_e4m3fn": (3, -6),
    "float8_e5m2": (2, -14),
}


def ulp(x: torch.Tensor, dtype: str = "bfloat16") -> torch.Tensor:
    """One ulp of storage format ``dtype`` (``"bfloat16"``, ``"float8_e4m3fn"``, ...; a
    ``torch.`` prefix is allowed) at ``|x|``, subnormals included; same shape and dtype as ``x``."""
    mant, min_exp = _FORMATS[dtype.removeprefix("torch.")]
    exp = torch.floor(torch.log2(x.abs().clamp_min(1e-30))).clamp_min(min_exp)
    return torch.exp2(exp - mant)
