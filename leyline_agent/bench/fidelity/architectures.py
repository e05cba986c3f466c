"""Splice mechanics on the attention shapes of the four MLA models of the paper (dummy weights).

For each model, a config with its published MLA shapes (hidden size, heads, ``q_lora_rank``,
``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``, rope theta and
scaling, context length) and everything else shrunk so that it runs on CPU: 2 layers (the first
dense, the second MoE with 4 small experts, as ``first_k_dense_replace = 1`` in the real models),
a 2048-token vocabulary, small FFNs (``hf_config``). ``arch_check.py`` serves it with
``--load-format dummy`` (bf16), runs the splice checks against it and prints the table.

Sources of the shapes are listed per model (``Arch.source`` / ``Arch.notes``); this machine has no
network, so values were taken from what is known of the published ``config.json`` files and
corroborated where possible (transformers 5.19's ``Glm4MoeLiteConfig`` defaults, public Megatron
launch scripts). Unsure and assumed values are marked in the notes, which are printed.

    python -m leyline_agent.bench.fidelity.architectures [--only NAME] [--out DIR]

(the same as ``python -m leyline_agent.bench.fidelity.arch_check``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

VOCAB = 2048


@dataclass(frozen=True)
class Arch:
    """One model: the published attention shapes and where they come from."""

    name: str
    architecture: str
    model_type: str
    source: str
    shapes: dict[str, Any]
    notes: tuple[str, ...] = field(default=())


_V2_LITE_ROPE = {
    "type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}

# DeepSeek-V2-Lite's attention shapes; Moonlight-16B-A3B (the V3 architecture) has the same.
_V2_LITE_ATTENTION = {
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}

ARCHS: tuple[Arch, ...] = (
    Arch(
        "DeepSeek-V2-Lite",
        "DeepseekV2ForCausalLM",
        "deepseek_v2",
        "huggingface.co/deepseek-ai/DeepSeek-V2-Lite, config.json",
        {
            **_V2_LITE_ATTENTION,
            "rope_theta": 10000,
            "rope_scaling": _V2_LITE_ROPE,
            "max_position_embeddings": 163840,
            "topk_method": "greedy",
            "scoring_func": "softmax",
        },
        ("values from memory of the published config.json (no network here)",),
    ),
    Arch(
        "Moonlight-16B-A3B",
        "DeepseekV3ForCausalLM",
        "deepseek_v3",
        "huggingface.co/moonshotai/Moonlight-16B-A3B, config.json",
        {
            **_V2_LITE_ATTENTION,
            "rope_theta": 50000,
            "rope_scaling": None,
            "max_position_embeddings": 8192,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": True,
        },
        (
            "values from memory of the published config.json (no network here); rope_theta "
            "50000 and vocab 163840 match public Megatron scripts for Moonlight, one of which "
            "notes that the published config has no rope_scaling",
        ),
    ),
    Arch(
        "GLM-4.7-Flash",
        "Glm4MoeLiteForCausalLM",
        "glm4_moe_lite",
        "huggingface.co/zai-org/GLM-4.7-Flash, config.json",
        {
            "hidden_size": 2048,
            "num_attention_heads": 20,
            "q_lora_rank": 768,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 192,
            "qk_rope_head_dim": 64,
            "v_head_dim": 256,
            "rope_theta": 1000000,
            "rope_scaling": None,
            "max_position_embeddings": 202752,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": True,
        },
        (
            "MLA shapes = transformers 5.19 Glm4MoeLiteConfig defaults (vocab 154880, 47 layers, "
            "20 heads, q_lora 768, kv_lora 512, nope 192, rope 64, v 256, 202752 positions), "
            "also given as 'glm4.7' values in public Megatron scripts",
            "UNSURE: rope_theta 1e6 and no rope scaling are from memory, not verified",
        ),
    ),
    Arch(
        "JoyAI-LLM-Flash",
        "DeepseekV3ForCausalLM",
        "deepseek_v3",
        "huggingface.co/jdopensource/JoyAI-LLM-Flash, README.md (model summary)",
        {
            "hidden_size": 2048,
            "num_attention_heads": 32,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "rope_theta": 10000,
            "rope_scaling": {
                "type": "yarn",
                "factor": 32,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            "max_position_embeddings": 131072,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": True,
        },
        (
            "model card: 40 layers (1 dense), hidden 2048, 32 heads, MLA, 256 experts (8 active, "
            "1 shared, dim 768), vocab 129K, 128K context; model_type joyai_llm_flash "
            "(custom code, described by vLLM-metax as a modified DeepSeek-V3)",
            "NOT FOUND: its config.json was not available here; q_lora 1536, kv_lora 512, "
            "nope 128, rope 64, v 128 and the YaRN rope (theta 1e4, factor 32 for 128K from 4K) "
            "are ASSUMED DeepSeek-V3-style values",
            "SGLang 0.5.23 has no JoyAI class: served as DeepseekV3ForCausalLM",
        ),
    ),
)


# NOTE: SGLang 0.5.23's CPU rope (``get_rope_cpu``) asserts a ``deepseek_yarn`` scaling. A model
# without rope scaling is served on CPU with YaRN of factor 1 and unit mscales instead: the same
# frequencies and cos/sin scale as plain RoPE (the ramp blends inv_freq with inv_freq / 1; both
# mscales are 1 for factor <= 1).
PLAIN_ROPE_AS_YARN = {
    "type": "yarn",
    "factor": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def hf_config(arch: Arch, *, moe: bool, plain_rope_as_yarn: bool = False) -> dict[str, Any]:
    """The served config: published attention shapes, shrunk depth/width elsewhere."""
    layers = 2
    cfg: dict[str, Any] = {
        "architectures": [arch.architecture],
        "model_type": arch.model_type,
        "vocab_size": VOCAB,
        "num_hidden_layers": layers,
        "first_k_dense_replace": 1 if moe else layers,
        "moe_layer_freq": 1,
        "num_key_value_heads": arch.shapes["num_attention_heads"],
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
        **arch.shapes,
    }
    if arch.model_type == "glm4_moe_lite":
        cfg["mlp_layer_types"] = ["dense"] + ["sparse" if moe else "dense"] * (layers - 1)
    if plain_rope_as_yarn and cfg["rope_scaling"] is None:
        cfg["rope_scaling"] = dict(
            PLAIN_ROPE_AS_YARN, original_max_position_embeddings=cfg["max_position_embeddings"]
        )
    return cfg


if __name__ == "__main__":
    from leyline_agent.bench.fidelity.arch_check import main

    main()
