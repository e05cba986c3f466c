"""The fidelity experiment end to end at CI size, once per architecture: a trained tiny MLA
(DeepSeek-V2) and GQA (Llama, 4 query / 2 KV heads) model, each served by a real ``leyline
serve`` (CPU, fp32), 20 cases per kind through the three paths (full context, AMORTIZE, FORGET),
checked against transformers' own argmax, then the report.

The model: the default one if ``leyline_agent/bench/fidelity/train.py`` has already cached it
(``$LEYLINE_CACHE/fidelity-model/<hash>``), else a 400-step model trained here (seed 0, one
thread, ~0.1-0.25 s of CPU per step) and cached the same way, so reruns do not retrain. 300 steps
do not learn the MLA model's ``carried`` lookup; see docs/fidelity.md.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from requires import require_sglang

from leyline_agent.bench.fidelity import divergence, report
from leyline_agent.bench.fidelity import train as training
from leyline_agent.bench.fidelity.task import (
    KINDS,
    MASK,
    QU,
    REAL_KINDS,
    USE,
    TaskSpec,
    edited,
    make_cases,
)

pytestmark = [pytest.mark.sglang, pytest.mark.live, pytest.mark.timeout(1800)]

TEST_STEPS = 400
N = 20


@pytest.fixture(scope="module", params=training.ARCHS)
def model_dir(request: pytest.FixtureRequest) -> Path:
    require_sglang()
    import torch

    torch.set_num_threads(1)
    default = dataclasses.replace(training.TrainSpec(), arch=request.param)
    if (training.default_out(default, TaskSpec()) / "fidelity.json").is_file():
        return training.train(default).model_dir
    return training.train(dataclasses.replace(default, steps=TEST_STEPS)).model_dir


@pytest.fixture(scope="module")
def result(model_dir: Path) -> dict[str, Any]:
    return divergence.run(model_dir, divergence.BenchSpec(n=N, batch=40), dtype="float32")


def test_task_cases_are_well_formed() -> None:
    spec = TaskSpec()
    cases = make_cases(50, seed=3, spec=spec)
    assert [c.kind for c in cases[:4]] == list(KINDS)
    for c in cases:
        s, e = c.chunk
        assert c.answer in spec.value_ids
        assert 0 < s < e < len(c.tokens) and max(c.tokens) < spec.vocab_size
        assert len(edited(c)) == len(c.tokens) - (e - s) + len(c.stub)
        assert c.tokens[c.tokens.index(USE) + 2] == MASK  # no downstream token restates a fact
        key = c.tokens[c.tokens.index(USE) + 1] if c.tokens[-1] == QU else c.tokens[-1]
        fact = spec.fact(key - spec.key(0), c.answer - spec.value(0))
        assert c.tokens.count(fact) == 1  # the full context states the answer's fact once
        assert (fact in c.tokens[s:e]) == (c.kind in REAL_KINDS), c.kind
    assert make_cases(5, seed=3, spec=spec) == cases[:20]  # reproducible


def test_model_learned_the_task(model_dir: Path) -> None:
    info = json.loads((model_dir / "fidelity.json").read_text())
    for kind, row in info["accuracy"].items():
        assert row["full"] >= 0.5, (kind, row)  # chance is 1/16
    cfg = json.loads((model_dir / "config.json").read_text())
    if info["train"]["arch"] == "mla":
        assert cfg["kv_lora_rank"] and cfg["qk_rope_head_dim"] and cfg["q_lora_rank"] is None
    else:
        assert cfg["architectures"] == ["LlamaForCausalLM"]
        assert cfg["num_key_value_heads"] == 2 < cfg["num_attention_heads"] == 4
    assert (model_dir / "model.safetensors").is_file()


def test_splice_mechanics_hold_on_every_case(result: dict[str, Any]) -> None:
    s = result["summary"]
    mech = s["mechanics"]
    assert mech["n"] == N * len(KINDS)
    assert all(v == mech["n"] for v in mech.values()), mech
    checks = s["checks"]
    assert checks["full_repeat_kl_max"] < 1e-6  # the full path is deterministic
    # FORGET is a re-prefill: it matches a fresh prefill of the edited context
    assert checks["forget_vs_fresh_kl_max"] < 1e-3
    assert checks["forget_vs_fresh_argmax_agree"] == mech["n"]
    # SGLang serves the trained checkpoint as transformers computes it (fp32 both)
    assert checks["server_vs_hf_full_argmax_agree"] == mech["n"]
    assert checks["server_vs_hf_fresh_argmax_agree"] == mech["n"]
    for kind in KINDS:
        g = s[kind]
        assert g["accuracy_full"]["k"] == g["accuracy_full_hf"]["k"], kind


def test_controls_amortize_follows_full_context(result: dict[str, Any]) -> None:
    ctrl = result["summary"]["control"]
    assert ctrl["accuracy_full"]["rate"] >= 0.5
    assert ctrl["amortize"]["agreement"]["rate"] >= 0.9
    assert ctrl["amortize"]["kl_mean"] < 0.1
    assert ctrl["forget"]["agreement"]["rate"] >= 0.85


def test_carried_fact_survives_amortize_and_not_forget(result: dict[str, Any]) -> None:
    carried = result["summary"]["carried"]
    assert carried["forget"]["accuracy"]["rate"] <= 0.3  # the fact is gone from the text
    assert carried["amortize"]["accuracy"]["rate"] >= carried["forget"]["accuracy"]["rate"] + 0.3
    assert carried["amortize"]["kl_mean"] < carried["forget"]["kl_mean"]


def test_report_is_consistent(result: dict[str, Any], tmp_path: Path) -> None:
    assert result["arch"] in training.ARCHS
    results, text = report.build(tmp_path, {"float32": result})
    print(text)  # shown with -rA / -s
    assert report.consistency_errors(result) == []
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["bench"]["float32"]["summary"] == json.loads(json.dumps(result["summary"]))
    assert on_disk["bench"]["float32"]["consistency_errors"] == []
    assert (tmp_path / "fidelity.png").stat().st_size > 10_000
    lines = (tmp_path / "cases-float32.jsonl").read_text().splitlines()
    assert len(lines) == N * len(KINDS)
    assert "carried" in text and "control" in text
    # a tampered summary is caught
    bad = json.loads(json.dumps(result))
    bad["summary"]["carried"]["amortize"]["accuracy"]["k"] += 1
    assert report.consistency_errors(bad)
