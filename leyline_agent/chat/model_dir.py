"""A Hugging Face model directory as a ``Renderer``: ``tokenizer.json``, the chat template and the
special-token template variables; the embedded default model when no directory is given."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from leyline_agent.chat.render import Renderer

_SPECIAL_TOKEN_VARS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | dict[str, str]:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(model_dir / "chat_template.json").get(
        "chat_template"
    )
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template}
    if not isinstance(template, str) or not template:
        raise ValueError(
            f"{model_dir}: no chat template (looked for chat_template.jinja, "
            "tokenizer_config.json's chat_template, chat_template.json)"
        )
    return template


@lru_cache(maxsize=8)
def _load(model_dir: str, sglang_compat: bool) -> Renderer:
    path = Path(model_dir)
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(
            f"{path}: no tokenizer.json (Leyline needs a fast tokenizer saved by transformers)"
        )
    config = _read_json(path / "tokenizer_config.json")
    specials = _read_json(path / "special_tokens_map.json")
    template_vars: dict[str, Any] = {}
    for name in _SPECIAL_TOKEN_VARS:
        value = _token_str(config.get(name)) or _token_str(specials.get(name))
        if value is not None:
            template_vars[name] = value
    return Renderer(
        Tokenizer.from_file(str(tokenizer_file)),
        _chat_template(path, config),
        template_vars,
        source=str(path),
        sglang_compat=sglang_compat,
    )


def load_renderer(model_path: str | Path | None = None, *, sglang_compat: bool = True) -> Renderer:
    """The renderer of a model directory, or of the embedded default model (``None``).

    A model directory needs ``tokenizer.json`` and a chat template (``chat_template.jinja``,
    ``tokenizer_config.json``'s ``chat_template``, or ``chat_template.json``). Loaded renderers
    are cached per directory (loading a 200k-token vocabulary takes about 2 s). With
    ``sglang_compat`` (default) messages and tools are normalised as SGLang's chat endpoint does
    before the template sees them (see ``sglang_messages``), so the tokens equal the server's.

    Raises:
        FileNotFoundError: no ``tokenizer.json``.
        ValueError: no chat template.
    """
    if model_path is None:
        from leyline_agent.embedded.model import default_model_dir

        model_path = default_model_dir()
    return _load(str(Path(model_path).resolve()), sglang_compat)
