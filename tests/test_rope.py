"""RopeSpec against SGLang's DeepSeek rotary embedding and transformers' rope init functions.

Both references compute frequencies in fp32 and `inv_freq` in fp64: they agree to a few fp32
ulps, so frequencies are compared with rtol 5e-7 (measured ≤ 1.3e-7).
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from leyline_agent.kernels.rope import (
    RopeBand,
    RopeSpec,
    inv_freq,
    mla_band,
    mscale,
    rope_band,
    rotate,
)

FREQ_RTOL = 5e-7


def deepseek_config(**scaling: Any) -> dict[str, Any]:
    """A DeepSeek-V2-Lite-like MLA config dict (transformers 4.x spelling)."""
    config: dict[str, Any] = {
        "model_type": "deepseek_v2",
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rope_theta": 10000.0,
        "max_position_embeddings": 163840,
    }
    if scaling:
        config["rope_scaling"] = {"type": "yarn", **scaling}
    return config


# --- transformers (Llama-style configs) ---------------------------------------------------

HF_CASES: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 2048,
        "rope_theta": 500000.0,
    },
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 2048,
        "rope_theta": 1000000.0,
    },
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 2048,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "beta_fast": 24,
        "beta_slow": 2,
        "rope_theta": 10000.0,
    },
    "yarn-attention-factor-no-truncate": {
        "rope_type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "attention_factor": 1.25,
        "truncate": False,
        "rope_theta": 150000.0,
    },
    "yarn-partial": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 2048,
        "partial_rotary_factor": 0.5,
        "rope_theta": 10000.0,
    },
}


def _hf_reference(params: dict[str, Any]) -> tuple[Any, torch.Tensor, float]:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = transformers.LlamaConfig(
        hidden_size=512,
        num_attention_heads=4,
        max_position_embeddings=16384,
        rope_parameters=dict(params),
    )
    if params["rope_type"] == "default":
        freqs, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        freqs, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    return config, freqs, float(factor)


@pytest.mark.parametrize("params", HF_CASES.values(), ids=HF_CASES.keys())
def test_matches_transformers(params: dict[str, Any]) -> None:
    config, want_freq, want_scale = _hf_reference(params)
    spec = RopeSpec.from_hf_config(config.to_dict())  # transformers 5: rope_parameters
    assert spec.pairing == "neox"
    torch.testing.assert_close(inv_freq(spec), want_freq.double(), rtol=FREQ_RTOL, atol=0)
    assert mscale(spec) == pytest.approx(want_scale, rel=1e-12)


@pytest.mark.parametrize("params", HF_CASES.values(), ids=HF_CASES.keys())
def test_transformers4_spelling_gives_same_spec(params: dict[str, Any]) -> None:
    config, _, _ = _hf_reference(params)
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "rope_type")}
    old = {
        "model_type": "llama",
        "hidden_size": 512,
        "num_attention_heads": 4,
        "max_position_embeddings": 16384,
        "rope_theta": params["rope_theta"],
    }
    if params["rope_type"] != "default":
        old["rope_scaling"] = {"type": params["rope_type"], **scaling}
    assert RopeSpec.from_hf_config(old) == RopeSpec.from_hf_config(config.to_dict())


def test_spec_fields_per_scaling() -> None:
    llama3 = RopeSpec.from_hf_config({"head_dim": 128, "rope_scaling": HF_CASES["llama3"]})
    assert (llama3.scaling, llama3.factor, llama3.rotary_dim) == ("llama3", 8.0, 128)
    assert (llama3.original_max_position_embeddings, llama3.high_freq_factor) == (2048, 4.0)
    linear = RopeSpec.from_hf_config({"head_dim": 64, "rope_parameters": HF_CASES["linear"]})
    torch.testing.assert_close(inv_freq(linear) * 4, inv_freq(RopeSpec(rotary_dim=64)))
    none = RopeSpec.from_hf_config({"hidden_size": 96, "num_attention_heads": 2})
    assert none == RopeSpec(rotary_dim=48, base=10000.0, pairing="neox", scaling="none")
    partial = RopeSpec.from_hf_config({"head_dim": 80, "partial_rotary_factor": 0.4})
    assert partial.rotary_dim == 32
    gptj = RopeSpec.from_hf_config({"head_dim": 64}, pairing="interleaved")
    assert gptj.pairing == "interleaved"
    yarn = RopeSpec.from_hf_config(
        {"head_dim": 64, "max_position_embeddings": 8192, "rope_scaling": {"type": "yarn"}}
    )
    assert (yarn.factor, yarn.original_max_position_embeddings) == (1.0, 8192)
    assert mscale(yarn) == 1.0


# --- SGLang DeepSeek-V2 --------------------------------------------------------------------

DEEPSEEK_CASES: dict[str, dict[str, Any]] = {
    "v2-lite": {
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "mscale-1.37": {"factor": 40, "original_max_position_embeddings": 4096, "mscale": 1.0},
    "small-attn-factor": {
        "factor": 4,
        "original_max_position_embeddings": 256,
        "beta_fast": 16,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "attn_factor": 0.9,
    },
}


def _sglang_rope(monkeypatch: pytest.MonkeyPatch, config: dict[str, Any]) -> torch.nn.Module:
    """What SGLang's DeepseekV2AttentionMLA builds for ``config`` (on CPU)."""
    base_mod = pytest.importorskip("sglang.srt.layers.rotary_embedding.base")
    monkeypatch.setattr(base_mod, "_is_cpu", True)
    from sglang.srt.layers.rotary_embedding.rope_variant import DeepseekScalingRotaryEmbedding

    scaling = config["rope_scaling"]
    keys = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attn_factor")
    return DeepseekScalingRotaryEmbedding(
        config["qk_rope_head_dim"],
        config["qk_rope_head_dim"],
        scaling["original_max_position_embeddings"],
        int(config["rope_theta"]),
        not config.get("rope_interleave", True),  # as deepseek_v2.py (see the source test)
        float(scaling["factor"]),
        torch.float32,
        device="cpu",
        **{k: scaling[k] for k in keys if k in scaling},
    )


@pytest.mark.parametrize("scaling", DEEPSEEK_CASES.values(), ids=DEEPSEEK_CASES.keys())
def test_matches_sglang_deepseek(monkeypatch: pytest.MonkeyPatch, scaling: dict[str, Any]) -> None:
    config = deepseek_config(**scaling)
    spec = RopeSpec.from_hf_config(config)
    assert (spec.scaling, spec.pairing, spec.rotary_dim) == ("deepseek_yarn", "interleaved", 64)
    rope = _sglang_rope(monkeypatch, config)
    want = rope._compute_inv_freq(float(scaling["factor"])).double()
    torch.testing.assert_close(inv_freq(spec), want, rtol=FREQ_RTOL, atol=0)
    assert mscale(spec) == pytest.approx(rope.mscale, rel=1e-12)

    # cos/sin cache = mscale · unit cos/sin; SGLang forms t·θ in fp32: error ≤ ulp(t·θ)/2.
    positions = torch.tensor([0, 1, 2, 255, 1000, rope.cos_sin_cache.shape[0] - 1])
    cos, sin = (rope.cos_sin_cache[positions].double() / rope.mscale).chunk(2, dim=-1)
    angles = positions.double()[:, None] * inv_freq(spec)
    atol = float(positions.max()) * 2**-24 + 1e-6
    torch.testing.assert_close(cos, angles.cos(), rtol=0, atol=atol)
    torch.testing.assert_close(sin, angles.sin(), rtol=0, atol=atol)

    # SGLang's own rotation of a k_pe [T, 1, 64] is mscale · our reference, same pairing.
    key = torch.randn(len(positions), 1, 64, generator=torch.Generator().manual_seed(0))
    _, got = rope.forward_native(positions, key.clone(), key.clone())
    want_key = mscale(spec) * rotate(key, positions, spec)
    torch.testing.assert_close(got.double(), want_key, rtol=0, atol=64 * atol)


def test_deepseek_pairing_follows_sglang_source() -> None:
    """SGLang: ``is_neox_style = not getattr(config, "rope_interleave", True)`` for k_pe."""
    found = importlib.util.find_spec("sglang")
    if found is None or found.origin is None:
        pytest.skip("sglang not installed")
    source = (Path(found.origin).parent / "srt/models/deepseek_v2.py").read_text()
    assert 'is_neox_style = not getattr(config, "rope_interleave", True)' in source
    assert 'rope_scaling["rope_type"] = "deepseek_yarn"' in source
    assert RopeSpec.from_hf_config(deepseek_config()).pairing == "interleaved"
    neox = RopeSpec.from_hf_config({**deepseek_config(), "rope_interleave": False})
    assert neox.pairing == "neox"
    explicit = RopeSpec.from_hf_config({**deepseek_config(), "rope_interleave": True})
    assert explicit.pairing == "interleaved"


def test_deepseek_transformers5_spelling() -> None:
    config = deepseek_config()
    config["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        **DEEPSEEK_CASES["v2-lite"],
    }
    old = deepseek_config(**DEEPSEEK_CASES["v2-lite"])
    assert RopeSpec.from_hf_config(config) == RopeSpec.from_hf_config(old)
    plain = {**deepseek_config(), "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    assert RopeSpec.from_hf_config(plain).scaling == "none"
    v2_lite = RopeSpec.from_hf_config(old)
    assert mscale(v2_lite) == pytest.approx(1.0)
    assert v2_lite.yarn_mscale == 0.707  # the config coefficient, not the cos/sin scale


# --- refusals and validation ----------------------------------------------------------------

REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "dynamic-4x": (
        {"head_dim": 64, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
        "dynamic",
    ),
    "dynamic-5x": (
        {"head_dim": 64, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
        "dynamic",
    ),
    "gpt2": ({"model_type": "gpt2", "n_embd": 768}, "no rotary"),
    "absolute": ({"model_type": "x", "position_embedding_type": "absolute"}, "absolute"),
    "alibi": ({"model_type": "falcon", "alibi": True, "head_dim": 64}, "ALiBi"),
    "longrope": (
        {"head_dim": 64, "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0]}},
        "longrope",
    ),
    "per-layer": (
        {"head_dim": 64, "rope_parameters": {"full_attention": {}, "sliding_attention": {}}},
        "per-layer",
    ),
    "mrope": (
        {"head_dim": 64, "rope_scaling": {"type": "default", "mrope_section": [16, 24, 24]}},
        "mrope",
    ),
    "mla-linear": (
        {**deepseek_config(), "rope_scaling": {"type": "linear", "factor": 2.0}},
        "deepseek_yarn",
    ),
}


@pytest.mark.parametrize("case", REFUSED.values(), ids=REFUSED.keys())
def test_refused_configs(case: tuple[dict[str, Any], str]) -> None:
    config, message = case
    with pytest.raises(ValueError, match=message):
        RopeSpec.from_hf_config(config)


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="even"):
        RopeSpec(rotary_dim=7)
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        RopeSpec(rotary_dim=8, scaling="yarn", factor=2.0)
    with pytest.raises(ValueError, match="pairing"):
        RopeSpec(rotary_dim=8, pairing="halves")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rotary_dim"):
        rotate(torch.zeros(2, 6), torch.zeros(2, dtype=torch.int64), RopeSpec(rotary_dim=8))
    with pytest.raises(ValueError, match="'factor'"):
        RopeSpec.from_hf_config({"head_dim": 64, "rope_scaling": {"type": "linear"}})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        RopeSpec.from_hf_config({"head_dim": 64, "rope_scaling": {"type": "yarn", "factor": 4}})
    with pytest.raises(ValueError, match="head_dim"):
        RopeSpec.from_hf_config({"model_type": "llama"})
    neox = RopeSpec.from_hf_config({"head_dim": 64, "rotary_pct": 0.25, "rotary_emb_base": 5e5})
    assert (neox.rotary_dim, neox.base) == (16, 5e5)


def test_bands() -> None:
    assert mla_band(deepseek_config()) == RopeBand(512, 64)
    assert rope_band(deepseek_config()) == RopeBand(512, 64)
    llama = {"hidden_size": 512, "num_attention_heads": 4, "partial_rotary_factor": 0.25}
    assert rope_band(llama) == RopeBand(0, 32)
    with pytest.raises(ValueError, match="MLA"):
        mla_band(llama)


# --- the reference rotation ------------------------------------------------------------------


@pytest.mark.parametrize("pairing", ["interleaved", "neox"])
def test_rotate_composes_and_preserves_norm(pairing: str) -> None:
    spec = RopeSpec.from_hf_config(deepseek_config(**DEEPSEEK_CASES["v2-lite"]), pairing=pairing)  # type: ignore[arg-type]
    x = torch.randn(5, 3, 64, dtype=torch.float64)
    a = torch.tensor([0, 7, 1000, 150_000, 163_839])
    b = torch.tensor([0, 3, 123, 9_999, 1])
    torch.testing.assert_close(rotate(x, torch.zeros(5, dtype=torch.int64), spec), x)
    torch.testing.assert_close(
        rotate(rotate(x, a, spec), b, spec), rotate(x, a + b, spec), rtol=0, atol=1e-9
    )
    torch.testing.assert_close(rotate(x, a, spec).norm(dim=-1), x.norm(dim=-1))


def test_pairings_differ_by_a_column_permutation() -> None:
    inter = RopeSpec(rotary_dim=8, pairing="interleaved")
    neox = RopeSpec(rotary_dim=8, pairing="neox")
    perm = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # interleaved column -> neox column
    x = torch.randn(4, 8, dtype=torch.float64)
    pos = torch.tensor([1, 2, 30, 400])
    torch.testing.assert_close(rotate(x, pos, inter)[:, perm], rotate(x[:, perm], pos, neox))
    assert math.isclose(inv_freq(inter)[1].item(), 10000 ** (-2 / 8))


def test_importing_rope_needs_no_torch() -> None:
    code = (
        "import sys, leyline_agent.kernels as k, leyline_agent.kernels.rope as r;"
        "r.RopeSpec.from_hf_config({'head_dim': 64}); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
