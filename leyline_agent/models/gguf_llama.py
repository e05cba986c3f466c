"""A llama.cpp ``llama`` GGUF file as a Hugging Face ``LlamaForCausalLM`` directory.

``convert(gguf_path, directory)`` reads the file with the ``gguf`` package, dequantizes every
tensor to fp32 (``gguf.dequantize``: Q4_0/Q4_1/Q8_0/K-quants/F16/F32), un-permutes the q/k
projections, and writes ``config.json``, ``generation_config.json``, ``model.safetensors``
(bf16) and the tokenizer files (``gguf_tokenizer``). No transformers, no accelerate.

NOTE: llama.cpp's ``convert_hf_to_gguf.py`` stores ``attn_q``/``attn_k`` rows permuted from
Hugging Face's rotate-half layout to interleaved RoPE pairs: per head, ``[n_head, 2, d/2]`` ->
``[n_head, d/2, 2]``. ``unpermute`` is its inverse (transformers' ``LlamaTensorProcessor`` does
the same); ``attn_k`` is permuted over the KV heads.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from leyline_agent.models.gguf_tokenizer import field, write_tokenizer_files

# GGUF tensor name (after ``blk.N.``) -> Hugging Face name (after ``model.layers.N.``)
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_config(reader: Any) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` from the GGUF's ``llama.*`` metadata.

    Raises:
        ValueError: the architecture is not ``llama`` or RoPE covers part of the head.
        KeyError: a required metadata field is missing.
    """
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r}: only 'llama' is supported")
    hidden = int(field(reader, "llama.embedding_length"))
    heads = int(field(reader, "llama.attention.head_count"))
    head_dim = hidden // heads
    rot = reader.fields.get("llama.rope.dimension_count")
    if rot is not None and int(rot.contents()) != head_dim:
        raise ValueError(f"partial RoPE ({rot.contents()} of {head_dim} dims) is not supported")
    if reader.fields.get("llama.rope.scaling.type") is not None:
        raise ValueError("GGUF RoPE scaling is not supported")
    names = {t.name for t in reader.tensors}
    tokens = field(reader, "tokenizer.ggml.tokens")

    def tid(key: str) -> int | None:
        f = reader.fields.get(f"tokenizer.ggml.{key}_token_id")
        return None if f is None else int(f.contents())

    eps = float(field(reader, "llama.attention.layer_norm_rms_epsilon"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(tokens),
        "hidden_size": hidden,
        "intermediate_size": int(field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field(reader, "llama.attention.head_count_kv")),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(field(reader, "llama.context_length")),
        "rms_norm_eps": float(f"{eps:.6g}"),  # float32 in the file: 9.9999997e-06 -> 1e-05
        "rope_theta": float(field(reader, "llama.rope.freq_base")),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": tid("bos"),
        "eos_token_id": tid("eos"),
        "pad_token_id": tid("padding"),
        "torch_dtype": "bfloat16",
    }


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation. ``w``: ``[n_head * d, hidden]`` -> same shape."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``.

    Raises:
        ValueError: a tensor this converter does not know.
    """
    if gguf_name in TOP_NAMES:
        return TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}")


def dequantized(reader: Any, config: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """``(hf_name, fp32 array)`` for every tensor of the file, q/k un-permuted, in file order.

    Shapes are Hugging Face's (``[out_features, in_features]``; GGUF lists dims reversed)."""
    from gguf import dequantize

    for t in reader.tensors:
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a copy: writable
        w = w.reshape([int(x) for x in reversed(t.shape.tolist())])
        if ".attn_q." in t.name:
            w = unpermute(w, config["num_attention_heads"])
        elif ".attn_k." in t.name:
            w = unpermute(w, config["num_key_value_heads"])
        yield hf_name(t.name), w


def convert(
    gguf_path: Path,
    directory: Path,
    *,
    progress: Callable[[Iterator[Any], int], Iterator[Any]] | None = None,
) -> dict[str, Any]:
    """Write the Hugging Face directory of ``gguf_path`` into ``directory`` (which must exist).

    ``progress(iterable, total)`` wraps the tensor loop (a progress bar). Weights are stored in
    bf16 (``model.safetensors``). Returns the ``config.json`` dict.

    Raises:
        ValueError: not a Llama GGUF this converter supports (message says why).
        ImportError: ``gguf``, ``torch`` or ``safetensors`` is not installed.
    """
    import torch
    from gguf import GGUFReader
    from safetensors.torch import save_file

    reader = GGUFReader(str(gguf_path))
    config = hf_config(reader)
    items: Iterator[tuple[str, np.ndarray]] = dequantized(reader, config)
    if progress is not None:
        items = progress(items, len(reader.tensors))
    tensors = {name: torch.from_numpy(w).to(torch.bfloat16) for name, w in items}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (directory / "generation_config.json").write_text(json.dumps(gen, indent=2))
    write_tokenizer_files(reader, directory, context=config["max_position_embeddings"])
    return config
