"""Hugging Face tokenizer files from a GGUF file's ``tokenizer.ggml.*`` metadata.

Supports the byte-level BPE tokenizers that llama.cpp calls ``gpt2`` with the pre-tokenizer
``smollm`` (SmolLM/SmolLM2, StarCoder-style): digits split one by one, then GPT-2's byte-level
split. ``write_tokenizer_files`` writes ``tokenizer.json``, ``special_tokens_map.json`` and
``tokenizer_config.json`` (with the GGUF's ``tokenizer.chat_template``), read by transformers,
SGLang and ``chat.model_dir.load_renderer`` alike. No transformers needed: ``tokenizers`` only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# llama.cpp's token types (gguf.TokenType): CONTROL tokens are the special ones.
CONTROL = 3
SUPPORTED_PRE = ("smollm",)


def field(reader: Any, key: str) -> Any:
    """The value of GGUF metadata field ``key`` (a str, number or list).

    Raises:
        KeyError: the file has no such field.
    """
    f = reader.fields.get(key)
    if f is None:
        raise KeyError(f"GGUF metadata has no {key!r}")
    return f.contents()


def build_tokenizer(reader: Any) -> Any:
    """A ``tokenizers.Tokenizer`` equal to the GGUF's (its vocab ids, merges and CONTROL tokens).

    Raises:
        ValueError: the tokenizer is not ``gpt2`` BPE with a supported pre-tokenizer.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind, pre = field(reader, "tokenizer.ggml.model"), field(reader, "tokenizer.ggml.pre")
    if kind != "gpt2" or pre not in SUPPORTED_PRE:
        raise ValueError(
            f"GGUF tokenizer {kind!r} with pre-tokenizer {pre!r}: only gpt2 BPE with "
            f"{', '.join(SUPPORTED_PRE)} is supported"
        )
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens")
    types: list[int] = field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF tokenizer: duplicate tokens in tokenizer.ggml.tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [t for t, ty in zip(tokens, types, strict=True) if ty == CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tok


def write_tokenizer_files(reader: Any, directory: Path, *, context: int) -> dict[str, Any]:
    """Write ``tokenizer.json``, ``special_tokens_map.json`` and ``tokenizer_config.json``.

    ``context``: ``model_max_length``. The bos/eos/pad/unk tokens are the GGUF's ids
    (``tokenizer.ggml.*_token_id``); the chat template is ``tokenizer.chat_template`` as is.

    Returns:
        the ``tokenizer_config.json`` dict.

    Raises:
        ValueError: an unsupported tokenizer (``build_tokenizer``) or no chat template.
        KeyError: a required metadata field is missing.
    """
    tok = build_tokenizer(reader)
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens")
    template = reader.fields.get("tokenizer.chat_template")
    if template is None:
        raise ValueError("GGUF metadata has no tokenizer.chat_template")
    names = {}
    for role, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
        f = reader.fields.get(f"tokenizer.ggml.{key}_token_id")
        if f is not None:
            names[f"{role}_token"] = tokens[int(f.contents())]
    tok.save(str(directory / "tokenizer.json"))
    (directory / "special_tokens_map.json").write_text(json.dumps(names, indent=2))
    config: dict[str, Any] = {
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": bool(_maybe(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context,
        **names,
        "chat_template": template.contents(),
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return config


def _maybe(reader: Any, key: str, default: Any) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()
