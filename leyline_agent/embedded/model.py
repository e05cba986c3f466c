"""The embedded default model: a tiny DeepSeek-V2 config served with ``--load-format dummy``.

Random weights: it exercises the mechanics (MLA KV layout ``[c_kv | k_pe]``, YaRN RoPE, the radix
cache, splices) and says nothing about quality. The shapes follow DeepSeek-V2's MLA with every
size shrunk; ``rope_scaling`` is YaRN ×16 over 8,192 original positions, so the context is 131,072
tokens (as long as real agent trajectories: a 50-turn debug-gym run reaches 52k), with
``mscale = mscale_all_dim = 0.707`` as in DeepSeek-V2 (the cos/sin scale is then 1; the softmax
scale carries YaRN's ``mscale_all_dim`` term). The vocabulary is the embedded tokenizer's
(tiktoken ``o200k_base`` plus ChatML specials, 200064 ids).

``default_model_dir()`` is the one directory of the embedded default: ``config.json`` beside the
tokenizer files, loaded by the renderer (``load_renderer()``), ``leyline serve`` and debug-gym's
``llm.yaml`` alike. ``TinyMLAConfig`` also describes the fidelity experiment's trained model.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from leyline_agent.cache import cache_root
from leyline_agent.embedded import tokenizer as tk


@dataclass(frozen=True)
class TinyMLAConfig:
    """A small ``DeepseekV2ForCausalLM`` (MLA, YaRN RoPE, no q LoRA); ``to_hf()`` is its
    Hugging Face ``config.json``.

    ``dense_layers``: the first ``dense_layers`` layers have a dense MLP (``first_k_dense_replace``;
    the rest are MoE). ``rope_key``: ``rope_scaling`` (transformers 4 spelling, ``rope_theta``
    beside it) or ``rope_parameters`` (transformers 5, ``rope_theta`` inside). ``router``: also
    write DeepSeek-V2's router keys (greedy top-k, softmax scores, one group).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    dense_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    max_position_embeddings: int
    yarn_factor: float
    yarn_original_max_position_embeddings: int
    eos_token_id: int | None
    bos_token_id: int | None
    pad_token_id: int | None = None
    n_routed_experts: int = 4
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    rope_theta: float = 10000.0
    beta_fast: float = 32
    beta_slow: float = 1
    mscale: float = 0.707
    mscale_all_dim: float = 0.707
    torch_dtype: str = "bfloat16"
    rope_key: Literal["rope_scaling", "rope_parameters"] = "rope_scaling"
    router: bool = False

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` dict (``architectures``, ``model_type`` ``deepseek_v2``)."""
        yarn: dict[str, Any] = {
            "rope_type": "yarn",
            "factor": self.yarn_factor,
            "original_max_position_embeddings": self.yarn_original_max_position_embeddings,
            "beta_fast": self.beta_fast,
            "beta_slow": self.beta_slow,
            "mscale": self.mscale,
            "mscale_all_dim": self.mscale_all_dim,
        }
        cfg: dict[str, Any] = {
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "first_k_dense_replace": self.dense_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": None,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
        }
        if self.router:
            cfg.update(
                moe_layer_freq=1,
                topk_method="greedy",
                n_group=1,
                topk_group=1,
                routed_scaling_factor=1.0,
                scoring_func="softmax",
                norm_topk_prob=False,
            )
        cfg["max_position_embeddings"] = self.max_position_embeddings
        if self.rope_key == "rope_scaling":
            cfg["rope_theta"] = self.rope_theta
            cfg["rope_scaling"] = {"type": "yarn", **yarn}
        else:
            cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": self.rope_theta, **yarn}
        cfg.update(
            rms_norm_eps=1e-6,
            hidden_act="silu",
            tie_word_embeddings=False,
            attention_bias=False,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
        )
        if self.pad_token_id is not None:
            cfg["pad_token_id"] = self.pad_token_id
        cfg["torch_dtype"] = self.torch_dtype
        # NOTE: transformers 5 (tokenization_utils_tokenizers._patch_mistral_regex) takes a local
        # model whose config.json lacks ``transformers_version`` for a pre-5 Mistral one and warns
        # of "an incorrect regex pattern ... incorrect tokenization". A false positive here: our
        # pre-tokenizer is o200k's own (tests/test_tokenizer.py: ids equal tiktoken's). Saying
        # which transformers the config is written for (the spelling of its RoPE keys) silences
        # exactly that check, as a config that transformers saves itself would.
        cfg["transformers_version"] = "4.57.0" if self.rope_key == "rope_scaling" else "5.0.0"
        return cfg


EMBEDDED = TinyMLAConfig(
    vocab_size=tk.DEFAULT_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=64,
    num_hidden_layers=2,
    dense_layers=2,
    num_attention_heads=4,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    max_position_embeddings=131072,
    yarn_factor=16.0,
    yarn_original_max_position_embeddings=8192,
    eos_token_id=tk.DEFAULT_EOS_TOKEN_ID,
    bos_token_id=None,
    router=True,
)


def _key(config: dict[str, Any]) -> str:
    h = hashlib.sha256(tk.build_key().encode())
    h.update(json.dumps(config, sort_keys=True).encode())
    return h.hexdigest()[:12]


def default_model_dir() -> Path:
    """The embedded default model directory, built on first use (about 5 s) and cached.

    Location: ``$LEYLINE_CACHE/embedded/deepseek-v2-o200k-<key>/`` (default cache
    ``~/.cache/leyline``); ``<key>`` changes with the config, the template and the tokenizer
    builder, so a stale directory is never reused. Concurrent first calls are safe (build in a
    temporary directory, then an atomic rename).

    Returns:
        directory with ``config.json`` and ``tk.TOKENIZER_FILES``.

    Raises:
        FileNotFoundError: ``tml-renderers`` (the source of the ranks file) is not installed.
    """
    config = EMBEDDED.to_hf()
    root = cache_root() / "embedded"
    final = root / f"deepseek-v2-o200k-{_key(config)}"
    if (final / "tokenizer_config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    tmp.chmod(0o755)
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tk.write_tokenizer(tmp)  # writes tokenizer_config.json last: the completion marker
        try:
            tmp.rename(final)
        except OSError:
            if not (final / "tokenizer_config.json").is_file():  # lost a race to a broken build
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def copy_tokenizer(directory: Path) -> None:
    """Copy the embedded tokenizer files into ``directory`` (a test model of another shape)."""
    src = default_model_dir()
    for name in tk.TOKENIZER_FILES:
        shutil.copy2(src / name, directory / name)
