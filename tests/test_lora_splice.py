"""Splices under a LoRA adapter (issue 27, part 3). One real ``leyline serve`` for the module: a
tiny Llama (2 layers, GQA 4/2 heads, random weights, bf16) with ``--enable-lora --lora-backend
torch_native --lora-paths ad1=DIR``, where DIR is a random rank-8 PEFT adapter on q/k/v written
here (safetensors + adapter_config.json; no hub). The weights are written, not ``--dummy``: SGLang
loads an adapter with the server's load format, and ``dummy`` refuses to load one ("DUMMY
load_format should use DummyModelLoader"). ``torch_native``: the default LoRA backend (``csgmv``)
is a Triton kernel.

Issue 27's given case: a splice under the adapter's namespace answered 200, but its replacement
was prefilled without the adapter (layer-0 K equal to the base model's bit for bit) and inserted
into the adapter's namespace, where the next LoRA request read it. A splice names its adapter
(``lora_path``) now: its replacement and FORGET's re-prefill run with it.

SGLang's CPU LoRA path pins host buffers (``pin_memory``), which fails without CUDA; the server
runs with ``LEYLINE_CPU_DEV=1`` (``leyline serve`` sets it on a CUDA-less host), whose
``cpu_dev.no_pin_memory`` makes pinning a no-op there.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from live import apply, assert_integrity, ns, stats, tree_slots
from requires import require_sglang

pytestmark = [pytest.mark.sglang, pytest.mark.live]

ADAPTER, RANK, HIDDEN = "ad1", 8, 128
PROJ_OUT = {"q_proj": 128, "k_proj": 64, "v_proj": 64}  # 4 heads / 2 KV heads of 32


def write_adapter(directory: Path, layers: int = 2, seed: int = 0) -> Path:
    """A random rank-8 LoRA adapter on q/k/v in PEFT's format (A, B ~ N(0, 0.1^2), alpha 16)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    weights = {}
    for i in range(layers):
        for proj, out in PROJ_OUT.items():
            pre = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            weights[f"{pre}.lora_A.weight"] = torch.randn(RANK, HIDDEN, generator=g) * 0.1
            weights[f"{pre}.lora_B.weight"] = torch.randn(out, RANK, generator=g) * 0.1
    directory.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()},
        str(directory / "adapter_model.safetensors"),
    )
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 16,
        "lora_dropout": 0.0, "bias": "none", "target_modules": list(PROJ_OUT),
    }  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    require_sglang()
    from leyline_agent.backends.sglang.launch import EmbeddedServer
    from leyline_agent.testing.tiny_models import write_random_weights, write_tiny_model

    root = tmp_path_factory.mktemp("lora")
    model = write_random_weights(write_tiny_model(root / "model", "llama3.1"))
    adapter = write_adapter(root / ADAPTER)
    with (
        EmbeddedServer(
            model_path=model,
            max_total_tokens=4096,
            extra_args=[
                "--enable-lora",
                "--lora-backend",
                "torch_native",
                "--lora-paths",
                f"{ADAPTER}={adapter}",
            ],  # fmt: skip
            env={"LEYLINE_DEBUG_ENDPOINTS": "1"},
        ) as srv,
        httpx.Client(base_url=srv.url, timeout=600) as client,
    ):
        yield client


def gen(c: httpx.Client, ids: list[int], key: str, lora: str | None) -> int:
    """One greedy token for ``ids`` in ``key`` under adapter ``lora``; its cached-token count."""
    body: dict[str, Any] = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "extra_key": key,
    }
    if lora is not None:
        body["lora_path"] = lora
    r = c.post("/generate", json=body)
    r.raise_for_status()
    return int(r.json()["meta_info"]["cached_tokens"])


def rows(c: httpx.Client, ids: list[int], key: str, lora: str | None) -> dict[str, Any]:
    body = {"op": "rows", "tokens": ids, "extra_key": key, "lora_path": lora}
    r = c.post("/leyline/debug/inspect", json=body)
    r.raise_for_status()
    return r.json()


def splice(c: httpx.Client, ids: list[int], ds: list[dict[str, Any]], key: str, lora: str | None):
    body = {"tokens": ids, "directives": ds, "extra_key": key, "lora_path": lora}
    return c.post("/leyline/splice", json=body)


def seq(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def k_rows(r: dict[str, Any], layer: int, span: range) -> Any:
    import torch

    return torch.tensor(r["values"][layer])[span.start : span.stop]


def max_diff(a: dict[str, Any], b: dict[str, Any], span: range, layers: int = 2) -> float:
    """Largest |K - K'| and |V - V'| over ``span`` in every layer."""
    import torch

    worst = 0.0
    for field in ("values", "v_values"):
        for layer in range(layers):
            x = torch.tensor(a[field][layer])[span.start : span.stop]
            y = torch.tensor(b[field][layer])[span.start : span.stop]
            worst = max(worst, float((x - y).abs().max()))
    return worst


def test_amortize_under_adapter_prefills_with_it(c: httpx.Client) -> None:
    from leyline_agent.directive import Directive
    from leyline_agent.testing.invariants import check_rows

    key, fresh_key, base_key = ns(), ns(), ns()
    toks = seq(64, 1)
    ds = [{"start": 20, "end": 24, "replacement": seq(6, 2)}]
    new, span = apply(toks, ds), range(20, 26)
    assert gen(c, toks, key, ADAPTER) == 0
    assert gen(c, toks, key, None) == 0  # the same tokens in the base model's namespace
    base_before = rows(c, toks, key, None)
    before = rows(c, toks, key, ADAPTER)
    assert before["cached"] == len(toks) and base_before["cached"] == len(toks)

    r = splice(c, toks, ds, key, ADAPTER)
    assert r.status_code == 200, r.text
    assert r.json()["prefilled"] == 6 and r.json()["new_length"] == len(new)
    after = rows(c, new, key, ADAPTER)
    assert after["cached"] == len(new)
    # the kept rows moved exactly (prefix as it was, tail RoPE-rotated by +2)
    assert check_rows(before, after, [Directive.model_validate(d) for d in ds]) > 0

    assert gen(c, new, fresh_key, ADAPTER) == 0
    fresh = rows(c, new, fresh_key, ADAPTER)
    assert gen(c, new, base_key, None) == 0
    base = rows(c, new, base_key, None)
    # layer-0 K depends on the token, its position and the adapter only: the replacement's
    # equals a fresh ad1 prefill's, and differs from the base model's (the adapter ran)
    adapted, base_k = k_rows(after, 0, span), k_rows(base, 0, span)
    assert float((adapted - k_rows(fresh, 0, span)).abs().max()) <= 1e-3 * float(
        adapted.abs().max()
    )
    assert float((adapted - base_k).abs().max()) > 0.1 * float(adapted.abs().max())
    assert max_diff(after, fresh, span) <= 2e-2  # both layers, K and V

    # the next ad1 request finds the edited sequence cached
    assert gen(c, new + [5], key, ADAPTER) == len(new)
    # the base model's namespace is untouched: the old sequence as it was, not the edited one
    assert rows(c, toks, key, None)["bits"] == base_before["bits"]
    assert rows(c, new, key, None)["cached"] == 20
    assert_integrity(stats(c))


def test_forget_under_adapter_equals_fresh_adapter_prefill(c: httpx.Client) -> None:
    key, fresh_key = ns(), ns()
    toks = seq(64, 5)
    ds = [{"start": 16, "end": 26, "replacement": seq(3, 6), "mode": "forget"}]
    new = apply(toks, ds)
    gen(c, toks, key, ADAPTER)
    r = splice(c, toks, ds, key, ADAPTER)
    assert r.status_code == 200, r.text
    assert r.json()["prefilled"] == len(new) - 16
    assert gen(c, new + [5], key, ADAPTER) == len(new)
    spliced = rows(c, new, key, ADAPTER)
    gen(c, new, fresh_key, ADAPTER)
    fresh = rows(c, new, fresh_key, ADAPTER)
    gen(c, new, fresh_key, None)
    base = rows(c, new, fresh_key, None)
    assert spliced["cached"] == fresh["cached"] == len(new)
    assert max_diff(spliced, fresh, range(0, len(new))) <= 2e-2
    tail = range(16, len(new))
    assert max_diff(spliced, base, tail) > 10 * max(max_diff(spliced, fresh, tail), 1e-3)
    assert_integrity(stats(c))


def test_unknown_adapter_is_refused_and_changes_nothing(c: httpx.Client) -> None:
    key = ns()
    toks = seq(40, 9)
    gen(c, toks, key, ADAPTER)
    before, slots, st0 = rows(c, toks, key, ADAPTER), tree_slots(c), stats(c)
    ds = [{"start": 4, "end": 8, "replacement": [7, 8]}]
    for lora in ("nope", "ad2"):
        r = splice(c, toks, ds, key, lora)
        assert r.status_code == 400, r.text
        assert f"unknown LoRA adapter {lora!r}" in r.json()["error"]["message"]
    r = c.post(
        "/leyline/fork", json={"tokens": toks, "extra_key": key, "target_extra_key": ns(),
                               "lora_path": "nope"},
    )  # fmt: skip
    assert r.status_code == 400, r.text
    # the adapter's sequence is not in the base namespace: a splice there is a 409, not a write
    r = splice(c, toks, ds, key, None)
    assert r.status_code == 409, r.text
    assert rows(c, toks, key, ADAPTER) == before and tree_slots(c) == slots
    st = stats(c)
    assert_integrity(st)
    assert (st["free"], st["cached"]) == (st0["free"], st0["cached"])


def test_fork_under_adapter_copies_into_the_adapters_namespace(c: httpx.Client) -> None:
    key, child = ns(), ns()
    toks = seq(48, 11)
    gen(c, toks, key, ADAPTER)
    body = {"tokens": toks, "extra_key": key, "target_extra_key": child, "lora_path": ADAPTER}
    r = c.post("/leyline/fork", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["copied"] == len(toks)
    assert rows(c, toks, child, ADAPTER)["bits"] == rows(c, toks, key, ADAPTER)["bits"]
    assert rows(c, toks, child, None)["cached"] == 0
    assert gen(c, toks + [5], child, ADAPTER) == len(toks)
    st = c.get("/leyline/stats").json()
    assert st["ok"], st
    assert_integrity(stats(c))


def test_proxy_session_splices_under_its_adapter(c: httpx.Client) -> None:
    """Through ``leyline proxy`` and the real ``openai`` client, a session that names the adapter
    as SGLang reads it (``model: "BASE:NAME"``, or ``lora_path`` in the body) has its splices
    name it too: every turn after the first finds all but its new tail cached under the adapter,
    and each edited turn is spliced with no error (a splice sent without the adapter would miss
    the adapter's namespace: a 409 and a full prefill of the edited turn)."""
    from test_proxy import (
        POLICY,
        TOOLS,
        agent_conversation,
        expected_plans,
        new_id,
        openai_client,
        serve_proxy,
        session_detail,
    )

    from leyline_agent.proxy import SESSION_HEADER

    turns = agent_conversation()
    plans = expected_plans(POLICY, turns)
    assert [bool(p.directives) for p in plans] == [False] * 3 + [True] * 3
    named = {"model": {"model": f"default:{ADAPTER}"},
             "lora_path": {"model": "default", "extra_body": {"lora_path": ADAPTER}}}  # fmt: skip
    with serve_proxy(str(c.base_url), POLICY) as proxy:
        for how, kwargs in named.items():
            sid = new_id(f"lora-{how}")
            client = openai_client(proxy, **{SESSION_HEADER: sid})
            usage = []
            for messages in turns:
                r = client.chat.completions.create(
                    messages=messages, tools=TOOLS, max_tokens=1, temperature=0, **kwargs
                )
                usage.append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
            detail = session_detail(proxy, sid)
            records = detail["records"]
            for t, ((prompt, cached), plan, rec) in enumerate(
                zip(usage, plans, records, strict=True)
            ):
                assert prompt == len(plan.tokens), (how, t)
                if t >= 1:
                    assert cached == prompt - len(plan.tail), (how, t, prompt, cached)
                if plan.directives:
                    assert rec["spliced"] and rec["splice_error"] is None, (how, t, rec)
            assert detail["splice_misses"] == 0 and len(detail["states"]) == 3, (how, detail)
    assert_integrity(stats(c))


def test_placement_adapter_is_another_namespace() -> None:
    """A session whose requests change adapter forgets its tokens and is shared again, as with a
    changed ``cache_salt``; the same adapter again changes nothing (``Placement.set_adapter``)."""
    from leyline_agent.client import LeylineClient
    from leyline_agent.inband import lora_adapter
    from leyline_agent.placement import Placement

    p = Placement(LeylineClient("http://127.0.0.1:9"), "own", shared="shared")
    assert p.adapter is None and not p.set_adapter(None)
    assert p.set_adapter(ADAPTER) and p.adapter == ADAPTER and p.extra_key == "shared"
    p.spliced()
    assert p.extra_key == "own" and not p.set_adapter(ADAPTER) and p.extra_key == "own"
    assert p.set_adapter("") and p.adapter is None and p.extra_key == "shared"
    assert lora_adapter({"model": f"base:{ADAPTER}", "lora_path": "other"}) == ADAPTER
    assert lora_adapter({"model": "base", "lora_path": ADAPTER}) == ADAPTER
    assert lora_adapter({"model": "base:", "lora_path": None}) is None
    assert lora_adapter({"model": "base"}) is None
