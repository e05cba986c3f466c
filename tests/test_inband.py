"""In-band edits (issue 28): the splice rides on ``/generate`` and ``/v1/chat/completions`` in the
``leyline_splice`` field and runs before the request, on a real ``leyline serve`` (the session's
server); the same correctness checks as the splice route (``test_sglang_backend.py``), plus: a
refused edit is a 4xx, the request does not run, nothing changes. ``resolve`` (the namespace
rules) without a server."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch
from live import VOCAB, apply, bf16_ulp, cached_seq, ns, rows, seq, stats

from leyline_agent import inband
from leyline_agent.embedded.model import EMBEDDED
from leyline_agent.kernels.rope import RopeSpec, rotate

CONFIG = EMBEDDED.to_hf()
LORA = CONFIG["kv_lora_rank"]
SPEC = RopeSpec.from_hf_config(CONFIG)


@pytest.fixture(scope="module")
def http(leyline_server: str) -> httpx.Client:
    with httpx.Client(base_url=leyline_server, timeout=300) as c:
        yield c


def generate(
    c: httpx.Client, ids: list[int], key: str, edit: dict[str, Any] | None
) -> httpx.Response:
    body: dict[str, Any] = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "extra_key": key,
    }
    if edit is not None:
        body[inband.FIELD] = edit
    return c.post("/generate", json=body)


@pytest.mark.sglang
@pytest.mark.parametrize("delta", [-4, 3])
def test_generate_with_an_amortize_edit_keeps_rows_bit_identical(
    http: httpx.Client, delta: int
) -> None:
    key = ns()
    toks = cached_seq(http, 64, seed=delta + 300, key=key)
    before = rows(http, toks, key)
    s, e = 20, 30
    ds = [{"start": s, "end": e, "replacement": seq(10 + delta, 31)}]
    new = apply(toks, ds)
    r = generate(http, new + [4242], key, {"tokens": toks, "directives": ds})
    assert r.status_code == 200, r.text
    result = inband.result(r.headers)
    assert result is not None and result.new_length == len(new)
    assert (result.prefix_reused, result.prefilled, result.rotated) == (s, 10 + delta, 64 - e)
    assert r.json()["meta_info"]["cached_tokens"] == len(new)  # the request read the splice
    assert len(r.headers[inband.WORKER_HEADER]) == 16
    after = rows(http, new, key)
    for layer in range(CONFIG["num_hidden_layers"]):
        old_bits, new_bits = torch.tensor(before["bits"][layer]), torch.tensor(after["bits"][layer])
        assert torch.equal(new_bits[:s], old_bits[:s])
        assert torch.equal(new_bits[e + delta :, :LORA], old_bits[e:, :LORA])
        old_pe = torch.tensor(before["values"][layer], dtype=torch.float64)[e:, LORA:]
        new_pe = torch.tensor(after["values"][layer], dtype=torch.float64)[e + delta :, LORA:]
        exact = rotate(old_pe, torch.full((old_pe.shape[0],), delta), SPEC)
        err = (new_pe - exact).abs()
        assert bool((err <= bf16_ulp(exact) + 1e-30).all()), float(err.max())
    assert stats(http)["ok"]


@pytest.mark.sglang
def test_generate_with_a_forget_edit_equals_a_fresh_prefill(http: httpx.Client) -> None:
    key = ns()
    toks = cached_seq(http, 60, seed=305, key=key)
    ds = [{"start": 12, "end": 24, "replacement": seq(3, 32), "mode": "forget"}]
    new = apply(toks, ds)
    r = generate(http, new + [5], key, {"tokens": toks, "directives": ds})
    assert r.status_code == 200, r.text
    result = inband.result(r.headers)
    assert result is not None and result.prefilled == len(new) - 12 and result.purged >= 60 - 12
    assert r.json()["meta_info"]["cached_tokens"] == len(new)
    spliced = rows(http, new, key)
    fresh_key = ns()
    generate(http, new, fresh_key, None).raise_for_status()
    fresh = rows(http, new, fresh_key)
    n = min(spliced["cached"], fresh["cached"])
    assert n >= len(new) - 1
    for layer in range(CONFIG["num_hidden_layers"]):
        a = torch.tensor(spliced["values"][layer])[:n]
        b = torch.tensor(fresh["values"][layer])[:n]
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)  # as the splice route's test
    assert stats(http)["ok"]


ONE = [{"start": 5, "end": 6, "replacement": [7, 8, 9]}]
BAD: dict[str, tuple[list[dict[str, Any]], dict[str, Any], int, int]] = {
    # directives, more fields, the splice's own status, the answer's status
    "end_past_sequence": ([{"start": 10, "end": 41, "replacement": [5]}], {}, 400, 400),
    "replacement_id_ge_vocab": ([{"start": 1, "end": 2, "replacement": [VOCAB]}], {}, 400, 400),
    "no_directives": ([], {}, 400, 400),  # refused before the splice: invalid field
    "past_input_limit": ([{"start": 1, "end": 2, "replacement": [7] * 20000}], {}, 400, 400),
    "failed_and_rolled_back": (ONE, {"debug_fail_after_prefill": True}, 500, 409),
}


@pytest.mark.sglang
@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("route", ["/generate", "/v1/chat/completions"])
def test_a_refused_edit_is_a_4xx_the_request_does_not_run_nothing_changes(
    http: httpx.Client, case: str, route: str
) -> None:
    key = ns()
    toks = cached_seq(http, 40, seed=310, key=key)
    ds, more, splice_status, status = BAD[case]
    before_rows, before_stats = rows(http, toks, key), stats(http)
    edit = {"tokens": toks, "directives": ds, **more}
    if route == "/generate":
        r = generate(http, toks + [1, 2, 3], key, edit)
    else:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "extra_key": key}
        r = http.post(route, json={**body, inband.FIELD: edit})
    assert r.status_code == status, r.text
    assert inband.refusal(r.status_code, r.headers, r.json()) is not None
    assert int(r.headers[inband.REFUSED_HEADER]) == splice_status
    assert r.json().get("error")  # says what to fix
    assert inband.result(r.headers) is None
    assert rows(http, toks, key) == before_rows
    after = stats(http)  # the request did not run either: it would have cached its prompt
    assert after == before_stats and after["ok"]


@pytest.mark.sglang
def test_an_edit_not_cached_or_in_another_namespace_is_refused(http: httpx.Client) -> None:
    key = ns()
    toks = cached_seq(http, 30, seed=320, key=key)
    ds = [{"start": 3, "end": 4, "replacement": [5]}]
    r = generate(http, seq(31, 321), key, {"tokens": seq(30, 322), "directives": ds})
    assert r.status_code == 409 and "not cached" in r.json()["error"]
    other = generate(http, toks, key, {"tokens": toks, "directives": ds, "extra_key": ns()})
    assert other.status_code == 400 and "namespace" in other.json()["error"]
    assert generate(http, toks + [1], key, None).json()["meta_info"]["cached_tokens"] == 30


@pytest.mark.sglang
def test_chat_with_an_edit_of_its_own_cached_prompt(http: httpx.Client) -> None:
    key = ns()
    msgs = [{"role": "user", "content": "alpha beta gamma delta epsilon zeta eta theta"}]
    body = {"messages": msgs, "max_tokens": 1, "extra_key": key, "return_prompt_token_ids": True}
    first = http.post("/v1/chat/completions", json=body)
    first.raise_for_status()
    ids = first.json()["choices"][0]["prompt_token_ids"]
    ds = [{"start": 2, "end": 3, "replacement": seq(2, 323)}]
    r = http.post(
        "/v1/chat/completions", json={**body, inband.FIELD: {"tokens": ids, "directives": ds}}
    )
    assert r.status_code == 200, r.text
    result = inband.result(r.headers)
    assert result is not None and result.new_length == len(ids) + 1 and result.prefilled == 2
    assert rows(http, apply(ids, ds), key)["cached"] == len(ids) + 1
    assert stats(http)["ok"]


def test_resolve_fills_the_namespace_and_refuses_another() -> None:
    ds = [{"start": 0, "end": 1, "replacement": []}]
    body = {"extra_key": "k", "cache_salt": "s", "routed_dp_rank": 1}
    req = inband.resolve({"tokens": [1, 2], "directives": ds}, body)
    assert (req.extra_key, req.cache_salt, req.dp_rank) == ("k", "s", 1)
    cross = inband.resolve(
        {"tokens": [1, 2], "directives": ds, "extra_key": "shared", "target_extra_key": "k"}, body
    )
    assert (cross.extra_key, cross.target_extra_key) == ("shared", "k")
    for bad, why in [
        ({"tokens": [1, 2], "directives": ds, "extra_key": "other"}, "namespace"),
        ({"tokens": [1, 2], "directives": ds, "cache_salt": "t"}, "namespace"),
        ({"tokens": [], "directives": ds}, "invalid"),
        ([1, 2], "must be an object"),
    ]:
        with pytest.raises(inband.InbandError, match=why):
            inband.resolve(bad, body)
    with pytest.raises(inband.InbandError, match="single request"):
        inband.resolve({"tokens": [1], "directives": ds}, {"extra_key": ["a", "b"]})
    # a LoRA request's splice runs under its adapter (issue 27): filled in, or the same, or refused
    lora_body = {**body, "lora_path": "ad1"}
    assert inband.resolve({"tokens": [1, 2], "directives": ds}, lora_body).lora_path == "ad1"
    assert inband.resolve({"tokens": [1, 2], "directives": ds}, body).lora_path is None
    for bad_lora, req_body in [("ad2", lora_body), ("ad1", body)]:
        with pytest.raises(inband.InbandError, match="lora_path="):
            inband.resolve({"tokens": [1, 2], "directives": ds, "lora_path": bad_lora}, req_body)
    with pytest.raises(inband.InbandError, match="single request"):
        inband.resolve({"tokens": [1], "directives": ds}, {"lora_path": ["ad1", None]})


def test_replayed_body_then_the_clients_own_channel() -> None:
    """After the body the middleware hands on the client's channel, never an invented
    ``http.disconnect``: SGLang polls ``is_disconnected()`` during a long request and aborts it
    on one (seen: /generate runs over ~4 s answered 400, the server's warm-up failed)."""
    import asyncio

    from leyline_agent.backends.sglang.inband import _replay

    calls = []

    async def client() -> dict[str, Any]:
        calls.append(1)
        return {"type": "http.request", "body": b"", "more_body": False}

    async def main() -> list[dict[str, Any]]:
        r = _replay(b'{"x": 1}', client)
        return [await r(), await r()]

    first, second = asyncio.run(main())
    assert first == {"type": "http.request", "body": b'{"x": 1}', "more_body": False}
    assert second["type"] == "http.request" and calls == [1]
