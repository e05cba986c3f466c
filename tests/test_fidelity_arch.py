"""The fidelity experiment's architecture switch, without a server: the GQA (Llama) model the
trainer builds, the cache hash that keeps the two models apart, and the MLA-vs-GQA table."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from leyline_agent.bench.fidelity import divergence, report
from leyline_agent.bench.fidelity.task import KINDS, TaskSpec

torch = pytest.importorskip("torch")
training = pytest.importorskip("leyline_agent.bench.fidelity.train")


def test_gqa_config_is_llama_with_fewer_kv_heads() -> None:
    spec = dataclasses.replace(training.TrainSpec(), arch="gqa")
    cfg = training.model_config(spec, TaskSpec())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 32)
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert cfg["vocab_size"] == TaskSpec().vocab_size == 312
    mla = training.model_config(training.TrainSpec(), TaskSpec())
    assert mla["kv_lora_rank"] == 64 and mla["qk_rope_head_dim"] == 32
    assert mla["rope_parameters"]["rope_type"] == "yarn"


def test_gqa_model_shapes() -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    spec = dataclasses.replace(training.TrainSpec(), arch="gqa")
    model = training.new_model(spec, TaskSpec())
    attn = model.model.layers[0].self_attn
    assert type(model).__name__ == "LlamaForCausalLM"
    assert attn.q_proj.out_features == 4 * 32 and attn.k_proj.out_features == 2 * 32
    assert attn.v_proj.out_features == 2 * 32 and len(model.model.layers) == 4
    assert sum(p.numel() for p in model.parameters()) == 670_848


def test_arch_enters_the_cache_hash_and_bad_specs_raise() -> None:
    mla = training.TrainSpec()
    gqa = dataclasses.replace(mla, arch="gqa")
    assert training.spec_hash(mla, TaskSpec()) != training.spec_hash(gqa, TaskSpec())
    assert training.default_out(mla, TaskSpec()) != training.default_out(gqa, TaskSpec())
    with pytest.raises(ValueError, match="kv_heads"):
        training.model_config(dataclasses.replace(gqa, kv_heads=3), TaskSpec())
    with pytest.raises(ValueError, match="unknown arch"):
        training.model_config(dataclasses.replace(mla, arch="mamba"), TaskSpec())


def _rows(kind: str, n: int, amortize_right: int, forget_right: int) -> list[dict[str, Any]]:
    """Per-case rows as ``divergence.run_cases`` writes them: answer 40, a wrong answer 41."""
    rows = []
    for i in range(n):
        a, f = (40 if i < amortize_right else 41), (40 if i < forget_right else 41)
        rows.append(
            {
                "kind": kind, "answer": 40, "full_argmax": 40, "fresh_argmax": f,
                "hf_full_argmax": 40, "hf_fresh_argmax": f, "full_repeat_kl": 0.0,
                "kl_forget_fresh": 0.0, "full_p_answer": 0.9, "full_margin": 3.0,
                "amortize_argmax": a, "forget_argmax": f, "amortize_kl": 0.01 * (a - 39),
                "forget_kl": 1.0 * (f - 39), "amortize_p_answer": 0.9, "forget_p_answer": 0.1,
                "mech": {"amortize_in_place": True},
            }
        )  # fmt: skip
    return rows


def test_compare_table_has_a_row_per_group_and_arch() -> None:
    def result(arch: str, right: int) -> dict[str, Any]:
        rows = [r for k in KINDS for r in _rows(k, 10, right, 1)]
        return {"arch": arch, "dtype": "float32", "summary": divergence.summarize(rows)}

    assert report.bench_label("mla", "float32") == "float32"
    assert report.bench_label("gqa", "bfloat16") == "gqa-bfloat16"
    benches = {"float32": result("mla", 9), "gqa-float32": result("gqa", 10)}
    s = benches["gqa-float32"]["summary"]
    assert s["checks"]["server_vs_hf_full_argmax_agree"] == 40
    assert s["checks"]["server_vs_hf_fresh_argmax_agree"] == 40
    assert s["carried"]["accuracy_full_hf"]["rate"] == 1.0
    lines = report.compare_table(benches).splitlines()
    assert len(lines) == 1 + 6 * 2  # header, (4 kinds + real + control) x 2 runs
    carried = [ln.split() for ln in lines if ln.startswith("carried ")]
    assert [c[1] for c in carried] == ["mla-float32", "gqa-float32"]
    assert carried[0][5] == "90.0%" and carried[1][5] == "100.0%"  # agree AMORTIZE
    assert carried[0][8] == "10.0%"  # agree FORGET


def test_mla_arch_configs_and_table() -> None:
    """``architectures.py`` (shapes, served configs) and ``arch_check.table``, without a server."""
    from leyline_agent.bench.fidelity import arch_check, architectures

    glm = next(a for a in architectures.ARCHS if a.model_type == "glm4_moe_lite")
    cfg = architectures.hf_config(glm, moe=True, plain_rope_as_yarn=True)
    assert (cfg["num_hidden_layers"], cfg["first_k_dense_replace"]) == (2, 1)
    assert cfg["mlp_layer_types"] == ["dense", "sparse"] and cfg["kv_lora_rank"] == 512
    assert cfg["rope_scaling"]["factor"] == 1.0  # plain RoPE served as YaRN of factor 1
    dense = architectures.hf_config(glm, moe=False)
    assert dense["first_k_dense_replace"] == 2 and dense["rope_scaling"] is None
    a = architectures.ARCHS[0]
    row: dict[str, Any] = {"name": a.name, "architecture": a.architecture, "source": a.source}
    row |= {"notes": list(a.notes), "shapes": a.shapes, "served": False, "errors": ["dense: x"]}
    lines = arch_check.table([row]).splitlines()
    assert lines[1].split()[:2] == [a.name, a.architecture] and "see errors" in lines[1]
    assert f"  {a.name}: error dense: x" in lines
    assert arch_check.DESCRIPTION == (architectures.__doc__ or "").splitlines()[0]
