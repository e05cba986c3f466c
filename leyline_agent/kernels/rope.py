"""RoPE math: what a model's config says about rotary embeddings, and a reference rotation.

A stored RoPE key is ``s · R(i) k``: the projection ``k`` rotated to absolute position ``i`` by
pairs of columns, each pair ``p`` turned by the angle ``i · inv_freq[p]``, and multiplied by
``s = mscale(spec)`` (YaRN's cos/sin scale, 1 for other scalings). Moving the key to position
``j`` is one more rotation by ``(j - i) · inv_freq`` with unit cos/sin (`kernels/delta_rotation`),
which never touches ``s``.

Sources followed (checked against the installed versions, tested in ``tests/test_rope.py``):

- SGLang 0.5.23 ``models/deepseek_v2.py``: an MLA config (``kv_lora_rank`` and
  ``qk_rope_head_dim``) rotates ``k_pe`` with ``is_neox_style = not config.rope_interleave``
  where an absent key reads as ``True``, so pairs are interleaved ``(2i, 2i+1)`` unless
  ``rope_interleave`` is false; any scaling dict is rewritten to ``deepseek_yarn``
  (``DeepseekScalingRotaryEmbedding``: YaRN frequencies, cos/sin multiplied by
  ``yarn_get_mscale(f, mscale) / yarn_get_mscale(f, mscale_all_dim) · attn_factor``).
- transformers 5.19 ``modeling_rope_utils``: ``linear``, ``llama3`` and ``yarn``; the default is
  ``1 / base ** (arange(0, d, 2) / d)``. Non-MLA models pair halves (``rotate_half``, "neox").

Both compute frequencies in fp32; `inv_freq` computes them in fp64 (they agree to a few fp32
ulps). ``dynamic`` NTK, ``longrope``, mrope, per-layer rope and models without RoPE are refused
with a ``ValueError``: their frequencies change with the sequence or do not exist, so a stored
key cannot be re-rotated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

if TYPE_CHECKING:
    import torch

Pairing = Literal["interleaved", "neox"]
Scaling = Literal["none", "linear", "llama3", "yarn", "deepseek_yarn"]

# Model types whose positions are absolute (learned or sinusoidal) or ALiBi: no rotary keys.
_NO_ROPE_MODEL_TYPES = frozenset(
    {"gpt2", "gpt_bigcode", "opt", "bloom", "mpt", "bert", "roberta", "t5", "bart", "whisper"}
)
_SCALINGS: tuple[str, ...] = ("none", "linear", "llama3", "yarn", "deepseek_yarn")


class RopeBand(NamedTuple):
    """Where the rope band sits in the last dim of a cache row (per head).

    MLA row ``[c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]``: ``RopeBand(kv_lora_rank,
    qk_rope_head_dim)``. MHA/GQA K head ``[head_dim]`` with (partial) rotary first:
    ``RopeBand(0, rotary_dim)``.
    """

    offset: int
    dim: int


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one model. Build it with `RopeSpec.from_hf_config`.

    ``yarn_mscale`` / ``yarn_mscale_all_dim`` are the config keys ``mscale`` / ``mscale_all_dim``
    (coefficients of ``log(factor)``); the resulting cos/sin scale is `mscale(spec)`.
    ``attention_factor`` is the ``yarn`` override of that scale or the ``deepseek_yarn``
    ``attn_factor`` multiplier; None means the default (computed / 1).
    """

    rotary_dim: int
    base: float = 10000.0
    pairing: Pairing = "neox"
    scaling: Scaling = "none"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    yarn_mscale: float | None = None
    yarn_mscale_all_dim: float | None = None
    attention_factor: float | None = None
    extrapolation_factor: float = 1.0
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be a positive even number, got {self.rotary_dim}")
        if self.pairing not in ("interleaved", "neox"):
            raise ValueError(f"pairing must be 'interleaved' or 'neox', got {self.pairing!r}")
        if self.scaling not in _SCALINGS:
            raise ValueError(f"scaling must be one of {_SCALINGS}, got {self.scaling!r}")
        if self.base <= 1.0:
            raise ValueError(f"rope base must be > 1, got {self.base}")
        if self.factor <= 0:
            raise ValueError(f"scaling factor must be > 0, got {self.factor}")
        if self.scaling in ("llama3", "yarn", "deepseek_yarn") and not (
            self.original_max_position_embeddings
        ):
            raise ValueError(f"{self.scaling} scaling needs original_max_position_embeddings")

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], *, pairing: Pairing | None = None) -> RopeSpec:
        """Read a Hugging Face ``config.json`` dict (transformers 4.x or 5.x spelling).

        ``pairing`` overrides the default ("interleaved" for MLA per SGLang, "neox" otherwise)
        for non-Llama-style models (e.g. GPT-J). Raises ``ValueError`` for configs whose keys
        cannot be re-rotated (dynamic NTK, longrope, mrope, per-layer rope, no RoPE at all).
        """
        _refuse_no_rope(config)
        params = _rope_params(config)
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        is_mla = "kv_lora_rank" in config and "qk_rope_head_dim" in config
        base = params.get("rope_theta") or config.get("rope_theta") or config.get("rotary_emb_base")
        base = float(base or 10000.0)
        if is_mla:
            rotary_dim = int(config["qk_rope_head_dim"])
            default_pairing: Pairing = (
                "interleaved" if config.get("rope_interleave", True) else "neox"
            )
        else:
            rotary_dim = _rotary_dim(config, params)
            default_pairing = "neox"
        common: dict[str, Any] = {
            "rotary_dim": rotary_dim,
            "base": base,
            "pairing": pairing or default_pairing,
        }
        max_pos = config.get("max_position_embeddings")
        # NOTE: SGLang (MLA) reads it from the scaling dict only; transformers prefers a
        # top-level original_max_position_embeddings (Phi-3) over the dict.
        orig = params.get("original_max_position_embeddings")
        if not is_mla:
            orig = config.get("original_max_position_embeddings") or orig
        orig = orig or max_pos

        if rope_type in ("dynamic", "ntk"):
            raise ValueError(
                "dynamic NTK RoPE scaling is not supported: its frequencies change with the "
                "sequence length, so a stored key cannot be re-rotated to a new position"
            )
        if rope_type in ("default", "none"):
            return cls(**common)
        if is_mla:
            # SGLang's DeepseekV2AttentionMLA rewrites any rope_scaling to deepseek_yarn.
            if rope_type not in ("yarn", "deepseek_yarn"):
                raise ValueError(
                    f"MLA config with rope_type {rope_type!r}: SGLang would force deepseek_yarn "
                    "onto it; only 'yarn'/'deepseek_yarn' are supported for MLA"
                )
            return cls(
                **common,
                scaling="deepseek_yarn",
                factor=float(params.get("factor", 1.0)),
                original_max_position_embeddings=_positive_int(
                    orig, "original_max_position_embeddings"
                ),
                beta_fast=float(params.get("beta_fast", 32)),
                beta_slow=float(params.get("beta_slow", 1)),
                yarn_mscale=float(params.get("mscale", 1)),
                yarn_mscale_all_dim=float(params.get("mscale_all_dim", 0)),
                attention_factor=float(params.get("attn_factor", 1.0)),
                extrapolation_factor=float(params.get("extrapolation_factor", 1.0)),
            )
        if rope_type == "linear":
            return cls(**common, scaling="linear", factor=_require(params, "factor", rope_type))
        if rope_type == "llama3":
            return cls(
                **common,
                scaling="llama3",
                factor=_require(params, "factor", rope_type),
                original_max_position_embeddings=_positive_int(
                    orig, "original_max_position_embeddings"
                ),
                low_freq_factor=_require(params, "low_freq_factor", rope_type),
                high_freq_factor=_require(params, "high_freq_factor", rope_type),
            )
        if rope_type == "yarn":
            orig = _positive_int(orig, "original_max_position_embeddings")
            factor = params.get("factor")
            attention_factor = params.get("attention_factor")
            return cls(
                **common,
                scaling="yarn",
                factor=float(factor)
                if factor is not None
                else _positive_int(max_pos, "max_position_embeddings") / orig,
                original_max_position_embeddings=orig,
                beta_fast=float(params.get("beta_fast") or 32),
                beta_slow=float(params.get("beta_slow") or 1),
                yarn_mscale=params.get("mscale"),
                yarn_mscale_all_dim=params.get("mscale_all_dim"),
                attention_factor=None if attention_factor is None else float(attention_factor),
                truncate=bool(params.get("truncate", True)),
            )
        raise ValueError(
            f"unsupported rope_type {rope_type!r}: supported are default, linear, llama3, yarn, "
            "deepseek_yarn (longrope switches frequencies with the sequence length)"
        )


def check_uniform_rope(config: dict[str, Any]) -> None:
    """Raise ``ValueError`` for configs whose keys cannot be re-rotated with one spec: no RoPE
    (absolute positions, ALiBi), NoPE layers, per-layer-type rope parameters, mrope."""
    _refuse_no_rope(config)
    _rope_params(config)


def _require(params: dict[str, Any], key: str, rope_type: str) -> float:
    if params.get(key) is None:
        raise ValueError(f"rope_type {rope_type!r} needs {key!r} in rope_scaling/rope_parameters")
    return float(params[key])


def _positive_int(value: Any, name: str) -> int:
    if not value or int(value) <= 0:
        raise ValueError(
            f"{name} (or max_position_embeddings) must be a positive int, got {value!r}"
        )
    return int(value)


def _refuse_no_rope(config: dict[str, Any]) -> None:
    model_type = config.get("model_type")
    pet = config.get("position_embedding_type")
    if model_type in _NO_ROPE_MODEL_TYPES or (pet is not None and pet != "rotary"):
        raise ValueError(
            f"config has no rotary embedding (model_type={model_type!r}, "
            f"position_embedding_type={pet!r}): positions are absolute, nothing to re-rotate"
        )
    if config.get("alibi") or config.get("use_alibi"):
        raise ValueError("config uses ALiBi, not RoPE: nothing to re-rotate")
    if 0 in (config.get("no_rope_layers") or ()) or config.get("mrope_section"):
        raise ValueError("per-layer NoPE and multimodal mrope configs are not supported")


def _rope_params(config: dict[str, Any]) -> dict[str, Any]:
    """The scaling dict: ``rope_parameters`` (transformers 5) or ``rope_scaling`` (4.x)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters/rope_scaling must be a dict, got {type(params)}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(
            f"per-layer-type rope parameters ({sorted(params)}) are not supported: "
            "one RopeSpec describes one rotation for every layer"
        )
    if "mrope_section" in params:
        raise ValueError("multimodal mrope (3-D positions) is not supported")
    return params


def _rotary_dim(config: dict[str, Any], params: dict[str, Any]) -> int:
    head_dim = config.get("head_dim")
    if not head_dim:
        if not (config.get("hidden_size") and config.get("num_attention_heads")):
            raise ValueError("config needs head_dim, or hidden_size and num_attention_heads")
        head_dim = config["hidden_size"] // config["num_attention_heads"]
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if factor is None:
        factor = config.get("rotary_pct", 1.0)
    return int(head_dim * float(factor))


def mla_band(config: dict[str, Any]) -> RopeBand:
    """The rope band of an MLA cache row ``[c_kv | k_pe]``: its last ``qk_rope_head_dim``."""
    if "kv_lora_rank" not in config or "qk_rope_head_dim" not in config:
        raise ValueError("not an MLA config: needs kv_lora_rank and qk_rope_head_dim")
    return RopeBand(int(config["kv_lora_rank"]), int(config["qk_rope_head_dim"]))


def rope_band(config: dict[str, Any]) -> RopeBand:
    """The rope band of one cache row/head: `mla_band` for MLA, else the first rotary_dim columns."""
    if "kv_lora_rank" in config and "qk_rope_head_dim" in config:
        return mla_band(config)
    return RopeBand(0, RopeSpec.from_hf_config(config).rotary_dim)


def _yarn_get_mscale(scale: float, coef: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * coef * math.log(scale) + 1.0


def mscale(spec: RopeSpec) -> float:
    """The factor YaRN multiplies cos/sin by (so every stored key carries it); 1 otherwise."""
    if spec.scaling == "deepseek_yarn":
        num = _yarn_get_mscale(spec.factor, spec.yarn_mscale if spec.yarn_mscale is not None else 1)
        den = _yarn_get_mscale(spec.factor, spec.yarn_mscale_all_dim or 0.0)
        attn = spec.attention_factor if spec.attention_factor is not None else 1.0
        return num / den * attn
    if spec.scaling == "yarn":
        if spec.attention_factor is not None:
            return spec.attention_factor
        if spec.yarn_mscale and spec.yarn_mscale_all_dim:
            return _yarn_get_mscale(spec.factor, spec.yarn_mscale) / _yarn_get_mscale(
                spec.factor, spec.yarn_mscale_all_dim
            )
        return _yarn_get_mscale(spec.factor)
    return 1.0


def inv_freq(
    spec: RopeSpec, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> torch.Tensor:
    """Angular frequency of each rotated pair, ``[rotary_dim // 2]``, computed in fp64.

    ``dtype`` (default float64) is the returned dtype. Unit: radians per position.
    """
    import torch

    d = spec.rotary_dim
    exps = torch.arange(0, d, 2, dtype=torch.float64) / d
    base_freq = 1.0 / (spec.base**exps)
    if spec.scaling == "none":
        freq = base_freq
    elif spec.scaling == "linear":
        freq = base_freq / spec.factor
    elif spec.scaling == "llama3":
        old_len = _original_len(spec)
        wavelen = 2 * math.pi / base_freq
        scaled = torch.where(
            wavelen > old_len / spec.low_freq_factor, base_freq / spec.factor, base_freq
        )
        smooth = (old_len / wavelen - spec.low_freq_factor) / (
            spec.high_freq_factor - spec.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
        medium = (wavelen >= old_len / spec.high_freq_factor) & (
            wavelen <= old_len / spec.low_freq_factor
        )
        freq = torch.where(medium, smoothed, scaled)
    else:  # yarn, deepseek_yarn
        low, high = _yarn_correction_range(spec)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolate = (1 - ramp) * spec.extrapolation_factor
        freq = base_freq / spec.factor * (1 - extrapolate) + base_freq * extrapolate
    return freq.to(dtype=dtype or torch.float64, device=device)


def _original_len(spec: RopeSpec) -> float:
    # NOTE: __post_init__ requires it for llama3/yarn/deepseek_yarn, the only scalings that ask.
    if spec.original_max_position_embeddings is None:
        raise ValueError(f"{spec.scaling} scaling needs original_max_position_embeddings")
    return float(spec.original_max_position_embeddings)


def _yarn_correction_range(spec: RopeSpec) -> tuple[float, float]:
    def dim_for(rotations: float) -> float:
        orig = _original_len(spec)
        return (spec.rotary_dim * math.log(orig / (rotations * 2 * math.pi))) / (
            2 * math.log(spec.base)
        )

    low, high = dim_for(spec.beta_fast), dim_for(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, spec.rotary_dim - 1)


def apply_rotation(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairing: Pairing
) -> torch.Tensor:
    """Rotate each pair of the last dim of ``x`` ``[..., d]`` by cos/sin ``[..., d // 2]``.

    Pair ``p`` is columns ``(2p, 2p+1)`` ("interleaved") or ``(p, p + d/2)`` ("neox");
    ``(a, b) -> (a·cos - b·sin, b·cos + a·sin)``. Computed in the dtype of the operands.
    """
    import torch

    if pairing == "neox":
        a, b = x.chunk(2, dim=-1)
    else:
        a, b = x[..., 0::2], x[..., 1::2]
    ra, rb = a * cos - b * sin, b * cos + a * sin
    if pairing == "neox":
        return torch.cat((ra, rb), dim=-1)
    return torch.stack((ra, rb), dim=-1).flatten(-2)


def rotate(
    x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Reference: a fresh rotation of ``x`` ``[N, ..., rotary_dim]`` to ``positions`` ``[N]``.

    Unit cos/sin (no `mscale`). Math and result in ``dtype`` (default float64, the oracle);
    ``positions`` are integers, converted exactly.
    """
    import torch

    dtype = dtype or torch.float64
    if x.shape[-1] != spec.rotary_dim:
        raise ValueError(f"x last dim {x.shape[-1]} != rotary_dim {spec.rotary_dim}")
    if positions.shape != x.shape[:1]:
        raise ValueError(f"positions shape {tuple(positions.shape)} != [{x.shape[0]}]")
    angles = positions.to(dtype)[:, None] * inv_freq(spec, dtype=dtype, device=x.device)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (spec.rotary_dim // 2,)
    return apply_rotation(
        x.to(dtype), angles.cos().reshape(shape), angles.sin().reshape(shape), spec.pairing
    )
