"""The embedded default model: a tiny DeepSeek-V2 config served with ``--load-format dummy``.

Random weights: it exercises the mechanics (MLA KV layout ``[c_kv | k_pe]``, YaRN RoPE, the radix
cache, splices) and says nothing about quality. The shapes follow DeepSeek-V2's MLA with every
size shrunk; ``rope_scaling`` is YaRN ×16 over 8,192 original positions, so the context is 131,072
tokens (as long as real agent trajectories: a 50-turn debug-gym run reaches 52k), with
``mscale = mscale_all_dim = 0.707`` as in DeepSeek-V2 (the cos/sin scale is then 1; the softmax
scale carries YaRN's ``mscale_all_dim`` term). The vocabulary is the
embedded tokenizer's (tiktoken ``o200k_base`` plus ChatML specials, 200064 ids), copied into the
model directory so that server and wrapper use the same tokenizer and chat template.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

EMBEDDED_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_layer_freq": 1,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "norm_topk_prob": False,
    "max_position_embeddings": 131072,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 8192,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}


def write_embedded_model(directory: Path, *, num_layers: int | None = None) -> Path:
    """Write ``config.json`` and the embedded tokenizer files into ``directory``.

    Returns the directory. Idempotent. Raises ``OSError`` on an unwritable directory.
    """
    from leyline_agent.tokenizer import (
        DEFAULT_EOS_TOKEN_ID,
        DEFAULT_VOCAB_SIZE,
        default_tokenizer_dir,
    )

    directory.mkdir(parents=True, exist_ok=True)
    cfg = dict(EMBEDDED_CONFIG)
    if num_layers is not None:
        cfg["num_hidden_layers"] = cfg["first_k_dense_replace"] = num_layers
    cfg.update(vocab_size=DEFAULT_VOCAB_SIZE, eos_token_id=DEFAULT_EOS_TOKEN_ID, bos_token_id=None)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in default_tokenizer_dir().iterdir():
        if f.is_file():
            shutil.copy2(f, directory / f.name)
    return directory
