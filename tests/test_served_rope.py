"""GQA/MHA splice parts without a server: `delta_rotate`'s ``copy_buffers`` (V rows travel with
their K rows, bit for bit) and `served_rope` (the spec read from SGLang's rotary modules, checked
against their own frequencies; unsupported and per-layer variants refused)."""

from __future__ import annotations

import pytest
import torch

from leyline_agent.kernels.delta_rotation import delta_rotate
from leyline_agent.kernels.rope import RopeBand, RopeSpec, rotate

SPEC = RopeSpec(rotary_dim=16, base=10000.0, pairing="interleaved")  # GLM-4-like partial rotary
BAND = RopeBand(0, 16)


def _cache(slots: int = 40, layers: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    k = [torch.randn(slots, 2, 32, generator=g).to(torch.bfloat16) for _ in range(layers)]
    v = [torch.randn(slots, 2, 24, generator=g).to(torch.bfloat16) for _ in range(layers)]
    return k, v


def test_copy_buffers_travel_bit_identical_and_k_band_rotates() -> None:
    k, v = _cache()
    k0, v0 = [t.clone() for t in k], [t.clone() for t in v]
    src, dst = torch.arange(0, 10), torch.arange(20, 30)
    old = torch.arange(100, 110)
    delta_rotate(k, src, dst, old, old - 7, SPEC, BAND, copy_buffers=v)
    for layer in range(2):
        assert torch.equal(v[layer][dst], v0[layer][src])  # V copied
        assert torch.equal(v[layer][30:], v0[layer][30:])  # nothing else written
        assert torch.equal(k[layer][dst][..., 16:], k0[layer][src][..., 16:])  # non-rotary dims
        exact = rotate(k0[layer][src][..., :16].double(), torch.full((10,), -7), SPEC)
        err = (k[layer][dst][..., :16].double() - exact).abs()
        ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
        assert bool((err <= ulp + 1e-30).all())


def test_in_place_leaves_copy_buffers_alone() -> None:
    k, v = _cache()
    v0 = [t.clone() for t in v]
    slots = torch.arange(5, 15)
    delta_rotate(k, slots, slots, slots, slots + 3, SPEC, BAND, copy_buffers=v)
    assert all(torch.equal(a, b) for a, b in zip(v, v0, strict=True))


def test_bad_copy_buffers_raise_before_any_write() -> None:
    k, v = _cache()
    k0 = [t.clone() for t in k]
    src, dst, pos = torch.arange(0, 4), torch.arange(10, 14), torch.arange(4)
    with pytest.raises(ValueError, match="slots"):
        delta_rotate(k, src, dst, pos, pos + 1, SPEC, BAND, copy_buffers=[v[0][:20]])
    with pytest.raises(TypeError, match="sequence"):
        delta_rotate(k, src, dst, pos, pos + 1, SPEC, BAND, copy_buffers=v[0])
    assert all(torch.equal(a, b) for a, b in zip(k, k0, strict=True))


# ---- served_rope: SGLang's rotary modules -> RopeSpec -----------------------------------------


@pytest.fixture(scope="module")
def get_rope():
    pytest.importorskip("sglang", reason="the sglang extra is not installed")
    import sglang.srt.layers.rotary_embedding.base as rope_base

    was = rope_base._is_cpu
    rope_base._is_cpu = True  # the CPU dev-mode patch (cpu_dev.py): no vllm import
    from sglang.srt.layers.rotary_embedding import get_rope

    yield lambda **kw: get_rope(dtype=torch.bfloat16, **kw)
    rope_base._is_cpu = was


MODULES = {
    "qwen3": ({"base": 1e6}, {"scaling": "none", "pairing": "neox", "rotary_dim": 64}),
    "glm4": (
        {"base": 10000, "is_neox_style": False, "partial_rotary_factor": 0.5},
        {"scaling": "none", "pairing": "interleaved", "rotary_dim": 32},
    ),
    "llama3.1": (
        {
            "base": 500000,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
        {"scaling": "llama3", "factor": 8.0},
    ),
    "qwen2.5-yarn": (
        {
            "base": 1e6,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32768,
            },
        },
        {"scaling": "yarn", "original_max_position_embeddings": 32768},
    ),
    "linear": (
        {"base": 10000, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {"scaling": "linear", "factor": 2.0},
    ),
}


@pytest.mark.parametrize("name", list(MODULES))
def test_spec_from_module_reproduces_its_frequencies(get_rope, name: str) -> None:
    from leyline_agent.backends.sglang.served_rope import (
        check_frequencies,
        module_inv_freq,
        spec_from_module,
    )
    from leyline_agent.kernels.rope import inv_freq

    kw, expected = MODULES[name]
    m = get_rope(head_size=64, rotary_dim=64, max_position=131072, **kw)
    spec = spec_from_module(m)
    for key, value in expected.items():
        assert getattr(spec, key) == value, (key, spec)
    check_frequencies(spec, m)
    rel = (inv_freq(spec) - module_inv_freq(m).double()).abs() / inv_freq(spec)
    assert float(rel.max()) < 1e-6


def test_unsupported_and_per_layer_variants_are_refused(get_rope) -> None:
    from torch import nn

    from leyline_agent.backends.sglang.served_rope import served_rope

    cfg = {"model_type": "llama", "head_dim": 64, "rope_theta": 10000.0}
    dynamic = get_rope(
        head_size=64,
        rotary_dim=64,
        max_position=4096,
        base=10000,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )
    with pytest.raises(ValueError, match="DynamicNTK"):
        served_rope(nn.ModuleList([dynamic]), cfg)
    local = get_rope(head_size=64, rotary_dim=64, max_position=4096, base=10000)
    global_ = get_rope(head_size=64, rotary_dim=64, max_position=4096, base=1000000)
    with pytest.raises(ValueError, match="per-layer RoPE"):
        served_rope(nn.ModuleList([local, global_]), cfg)
    assert served_rope(nn.ModuleList([local, local]), cfg) == (
        RopeSpec(rotary_dim=64, base=10000.0),
        "model",
    )
    assert served_rope(None, cfg)[1] == "config"
    with pytest.raises(ValueError, match="per-layer-type"):
        served_rope(nn.ModuleList([local]), {**cfg, "rope_parameters": {"full": {}, "swa": {}}})
