"""Tiny dummy models per family (2 layers, GQA 4/2 heads, the embedded tokenizer): configs shaped
like each family's public config, and the RoPE their keys must come out with.

Served with ``leyline serve --dummy`` by ``tests/test_gqa_models.py``,
``tests/test_splice_integrity.py`` and ``experiments/backend/check_model.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_BASE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

# Tiny configs shaped like each family's public config (rope and attention keys as released).
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
    },
    "llama3.1": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "qwen2.5-yarn": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    },
    "glm4": {
        "architectures": ["Glm4ForCausalLM"],
        "model_type": "glm4",
        "max_position_embeddings": 32768,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "sliding_window": None,
    },
}

# Families a splice must refuse (501), served by tests/test_gqa_models.py. Gemma-2 alternates
# sliding-window (even layers) and global layers in one plain MHA pool: SGLang sets the window on
# the layer's RadixAttention (window - 1 = 63 here), which ``kv_layout.check_full_attention``
# reads. (Llama/Mistral/Qwen2 ignore ``sliding_window`` in SGLang 0.5.23: full attention.) Soft
# caps off: the CPU attention backends do not apply them.
REFUSED_FAMILIES: dict[str, dict[str, Any]] = {
    "gemma2-swa": {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "sliding_window": 64,
        "query_pre_attn_scalar": 32,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "tie_word_embeddings": True,
    },
}

# What each family's keys must come out as (read from SGLang's model code, not from the server).
EXPECTED_ROPE: dict[str, dict[str, Any]] = {
    "qwen3": {"rotary_dim": 32, "pairing": "neox", "scaling": "none"},
    "llama3.1": {"rotary_dim": 32, "pairing": "neox", "scaling": "llama3"},
    "qwen2.5-yarn": {"rotary_dim": 32, "pairing": "neox", "scaling": "yarn"},
    "glm4": {"rotary_dim": 16, "pairing": "interleaved", "scaling": "none"},
    "mistral": {"rotary_dim": 32, "pairing": "neox", "scaling": "none"},
}


def write_tiny_model(directory: Path, family: str, **overrides: Any) -> Path:
    """Write ``config.json`` for ``family`` (2 layers, GQA 4/2 heads) plus the embedded tokenizer.

    ``family``: a key of ``FAMILIES`` or ``REFUSED_FAMILIES``. ``overrides`` replace config keys.
    Returns ``directory``. Serve it with ``--dummy``. Raises ``ValueError`` on an unknown family.
    """
    from leyline_agent.embedded.model import copy_tokenizer
    from leyline_agent.embedded.tokenizer import DEFAULT_EOS_TOKEN_ID, DEFAULT_VOCAB_SIZE

    families = FAMILIES | REFUSED_FAMILIES
    if family not in families:
        raise ValueError(f"unknown family {family!r}; one of {sorted(families)}")
    cfg = {
        **_BASE,
        **families[family],
        "vocab_size": DEFAULT_VOCAB_SIZE,
        "eos_token_id": DEFAULT_EOS_TOKEN_ID,
        **overrides,
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    copy_tokenizer(directory)
    return directory


def write_random_weights(directory: Path, seed: int = 0) -> Path:
    """Save random weights (transformers' own initialisation, bf16 safetensors) for the config in
    ``directory``; serve it without ``--dummy``. SGLang's dummy weights are uniform in ±1e-3,
    which an fp8 KV cache stores as zeros; these give keys of order 1 (qk-norm) or 0.1."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    model.to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)
    return directory
