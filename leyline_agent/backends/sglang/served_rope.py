"""The RoPE spec of the model the server actually runs, read from its rotary-embedding modules.

One source of truth: the ``RotaryEmbedding`` objects SGLang built for the loaded model (found on
``scheduler.tp_worker.model_runner.model``) give ``rotary_dim``, ``base``, ``is_neox_style`` and
the scaling parameters; the resulting `RopeSpec` must reproduce the module's own frequencies
(``_compute_inv_freq``) to fp32 precision, else the splice is refused. The HF config is only a
fallback when the model holds no rotary module, and its guards (no RoPE, NoPE layers, per-layer
rope parameters, mrope) always apply.

=============================================  ===================================
SGLang class (exact type)                      `RopeSpec`
=============================================  ===================================
``RotaryEmbedding``                            ``scaling="none"``
``LinearScalingRotaryEmbedding`` (one factor)  ``linear``
``Llama3RotaryEmbedding``                      ``llama3``
``YaRNScalingRotaryEmbedding``                 ``yarn`` (``attention_factor`` = its mscale)
``DeepseekScalingRotaryEmbedding``             ``deepseek_yarn`` (same)
=============================================  ===================================

Anything else (dynamic NTK, longrope, mrope, dual-chunk, Fourier, Gemma-4 proportional) is
refused: its angles are not ``position · inv_freq`` with fixed frequencies. Two different specs
in one model (per-layer RoPE variants, e.g. local/global layers) are refused too.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Literal

import torch

from leyline_agent.kernels.rope import RopeSpec, check_uniform_rope, inv_freq

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger(__name__)

# fp32 frequencies (SGLang) vs fp64 (ours): pow() in fp32 is good to a few ulps.
FREQ_RTOL = 1e-5

Source = Literal["model", "config"]


def served_model(scheduler: Any) -> nn.Module | None:
    """The scheduler's loaded model, or None where the worker exposes none."""
    try:
        return scheduler.tp_worker.model_runner.model
    except AttributeError:
        logger.warning("leyline: no model on scheduler.tp_worker.model_runner; using the config")
        return None


def served_rope(model: nn.Module | None, hf_config: dict[str, Any]) -> tuple[RopeSpec, Source]:
    """The spec every rotary module of ``model`` agrees on, and where it came from.

    Raises ``ValueError`` with the reason when the model's RoPE cannot be δ-rotated.
    """
    check_uniform_rope(hf_config)
    modules = _rotary_modules(model) if model is not None else []
    if not modules:
        return RopeSpec.from_hf_config(hf_config), "config"
    specs: dict[RopeSpec, nn.Module] = {}
    for m in modules:
        spec = spec_from_module(m)
        check_frequencies(spec, m)
        specs.setdefault(spec, m)
    if len(specs) > 1:
        raise ValueError(
            "per-layer RoPE variants: the model's rotary modules disagree "
            f"({[_describe(s) for s in specs]}); one splice rotates every layer alike"
        )
    return next(iter(specs)), "model"


def _rotary_modules(model: nn.Module) -> list[nn.Module]:
    from leyline_agent.backends.sglang.compat import (
        DualChunkRotaryEmbedding,
        FourierRotaryEmbedding,
        Phi3LongRoPEScaledRotaryEmbedding,
        RotaryEmbedding,
    )

    kinds = (
        RotaryEmbedding,
        DualChunkRotaryEmbedding,
        FourierRotaryEmbedding,
        Phi3LongRoPEScaledRotaryEmbedding,
    )
    seen: dict[int, nn.Module] = {}
    for m in model.modules():
        if isinstance(m, kinds):
            seen.setdefault(id(m), m)
    return list(seen.values())


def spec_from_module(m: nn.Module) -> RopeSpec:
    """Map one SGLang rotary module to a `RopeSpec`. Raises ``ValueError`` for other classes."""
    from leyline_agent.backends.sglang.compat import (
        DeepseekScalingRotaryEmbedding,
        LinearScalingRotaryEmbedding,
        Llama3RotaryEmbedding,
        RotaryEmbedding,
        YaRNScalingRotaryEmbedding,
    )

    kind = type(m)
    if getattr(m, "position_start", 0):
        raise ValueError(f"{kind.__name__} with position_start {m.position_start} is not supported")
    common: dict[str, Any] = {
        "rotary_dim": int(m.rotary_dim),
        "base": float(m.base),
        "pairing": "neox" if m.is_neox_style else "interleaved",
    }
    if kind is RotaryEmbedding:
        return RopeSpec(**common)
    if kind is LinearScalingRotaryEmbedding:
        if len(m.scaling_factors) != 1:
            raise ValueError(f"linear RoPE with several factors {m.scaling_factors} (LoRA)")
        return RopeSpec(**common, scaling="linear", factor=float(m.scaling_factors[0]))
    if kind is Llama3RotaryEmbedding:
        return RopeSpec(
            **common,
            scaling="llama3",
            factor=float(m.scaling_factor),
            original_max_position_embeddings=int(m.orig_max_position),
            low_freq_factor=float(m.low_freq_factor),
            high_freq_factor=float(m.high_freq_factor),
        )
    if kind in (YaRNScalingRotaryEmbedding, DeepseekScalingRotaryEmbedding):
        deepseek = kind is DeepseekScalingRotaryEmbedding
        return RopeSpec(
            **common,
            scaling="deepseek_yarn" if deepseek else "yarn",
            factor=float(m.scaling_factor),
            original_max_position_embeddings=int(m.max_position_embeddings),
            beta_fast=float(m.beta_fast),
            beta_slow=float(m.beta_slow),
            # the module keeps only the resulting cos/sin scale; coefficients 0 make it exact
            yarn_mscale=0.0 if deepseek else None,
            yarn_mscale_all_dim=0.0 if deepseek else None,
            attention_factor=float(m.mscale),
            extrapolation_factor=float(m.extrapolation_factor),
            truncate=bool(getattr(m, "truncate", True)),
        )
    raise ValueError(
        f"RoPE module {kind.__name__} is not supported: supported are default, linear, llama3, "
        "yarn and deepseek_yarn (dynamic NTK, longrope, mrope and dual-chunk angles are not "
        "position x fixed frequencies)"
    )


def module_inv_freq(m: nn.Module) -> torch.Tensor:
    """The frequencies ``m`` builds its cos/sin cache from (fp32, radians per position)."""
    from leyline_agent.backends.sglang.compat import (
        DeepseekScalingRotaryEmbedding,
        LinearScalingRotaryEmbedding,
        YaRNScalingRotaryEmbedding,
    )

    if isinstance(m, (YaRNScalingRotaryEmbedding, DeepseekScalingRotaryEmbedding)):
        return m._compute_inv_freq(m.scaling_factor).float().cpu()
    freq = m._compute_inv_freq(m.base).float().cpu()
    if isinstance(m, LinearScalingRotaryEmbedding):  # positions are divided by the factor
        freq = freq / m.scaling_factors[0]
    return freq


def check_frequencies(spec: RopeSpec, m: nn.Module) -> None:
    """Raise ``ValueError`` unless ``inv_freq(spec)`` reproduces the module's frequencies."""
    ours = inv_freq(spec)
    theirs = module_inv_freq(m).double()
    if ours.shape != theirs.shape:
        raise ValueError(f"rotary_dim mismatch: {tuple(ours.shape)} vs {tuple(theirs.shape)}")
    rel = float(((ours - theirs).abs() / theirs.abs().clamp_min(1e-30)).max())
    if rel > FREQ_RTOL:
        raise ValueError(
            f"the kernel's frequencies for {_describe(spec)} differ from the server's "
            f"{type(m).__name__} by {rel:.2e} (relative): refusing rather than rotating wrong"
        )


def _describe(spec: RopeSpec) -> str:
    d = dataclasses.asdict(spec)
    keep = ("rotary_dim", "base", "pairing", "scaling", "factor")
    return ", ".join(f"{k}={d[k]}" for k in keep)
