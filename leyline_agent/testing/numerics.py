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


def band_unit(exact: torch.Tensor, source: torch.Tensor, dtype: str = "bfloat16") -> torch.Tensor:
    """The tolerance of a re-rotated rope band, elementwise: 1 ulp of ``dtype`` at the exact
    value, or 2^-22 of the source row's band norm where that is larger (the fp32 rotation's own
    rounding, which a component that cancels to near zero cannot go below).

    Args:
        exact: ``[..., band]`` the exact (fp64) rotation; source: ``[..., band]`` the stored rows
            before it (same shape). Returns ``exact``'s shape and dtype.

    Measured: SmolLM2-135M layer 11 (real weights) showed 8.13 plain bf16 ulps; offline, bf16 rows
    moved by ``delta_rotate`` showed 6.74 plain ulps at |exact| 3.4e-6 in a band of norm 120
    (abs error 1.0e-7, 8e-10 of the norm), 0.65 of this unit; MLA page 64: 1.68 plain ulps at
    |exact| 1.4e-11 in a band of norm 5.1e-6.
    """
    floor = source.norm(dim=-1, keepdim=True) * 2.0**-22
    return torch.maximum(ulp(exact, dtype), floor)
