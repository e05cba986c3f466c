"""Tolerances the KV checks share (tests, fuzzer, model check, fidelity architectures)."""

from __future__ import annotations

import torch


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at ``|x|`` (8 significant bits), same shape and dtype as ``x``."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)
