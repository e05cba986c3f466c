"""One teacher-forced turn through SGLang's ``/generate`` with the rendered token ids (what
``leyline replay`` sends): the token-level front door beside ``chat_turn.py``."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from leyline_agent import gateway, inband
from leyline_agent.accounting import TurnRecord
from leyline_agent.client import GenerateResult
from leyline_agent.session import Pending, SessionCore


def generate_turn(
    core: SessionCore,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None = None,
    *,
    max_new_tokens: int = 1,
) -> tuple[TurnRecord, GenerateResult]:
    """Plan and splice (``SessionCore.begin``), send ``plan.tokens`` to ``/generate`` in the
    session's request namespace (greedy, ``max_new_tokens``), record the turn. Behind a gateway
    (``client.gateway``) the splice rides on the request (``gateway.py``) with the session's
    routing key. Raises ``httpx.HTTPError`` as ``LeylineClient.generate``; ``PolicyError``,
    ``DirectiveError`` as ``SessionCore.plan``."""
    where = core.placement
    if where.client.gateway:
        pending = core.plan(messages, tools)
        out = _through_gateway(core, pending, max_new_tokens)
    else:
        pending = core.begin(messages, tools)
        out = where.client.generate(
            pending.plan.tokens, extra_key=where.extra_key, cache_salt=where.salt,
            max_new_tokens=max_new_tokens,
        )  # fmt: skip
    record = core.finish(
        pending,
        prompt_tokens=out.prompt_tokens,
        cached_tokens=out.cached_tokens,
        request_ms=out.e2e_ms,
        ttft_ms=out.meta.get("ttft_ms") or out.e2e_ms,
        first_token=out.output_ids[0] if out.output_ids else None,
        messages=messages,
        output_ids=out.output_ids,
    )
    return record, out


def _through_gateway(core: SessionCore, pending: Pending, max_new_tokens: int) -> GenerateResult:
    """``/generate`` with the in-band edit (``gateway.defer``), sent again without it when the
    worker refused it (a moved session: a cold prefill, the miss counted by ``gateway.settle``)."""
    http, tokens = core.placement.client.http, pending.plan.tokens
    edit = gateway.defer(core, pending)
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    t0 = time.perf_counter()
    while True:
        body: dict[str, Any] = {"input_ids": list(tokens), "sampling_params": params}
        body = gateway.namespace(core, edit).apply(body)
        if edit is not None:
            body[inband.FIELD] = edit
        r = http.post("/generate", json=body, headers=gateway.routing_headers(core))
        try:
            data = r.json()
        except ValueError:
            data = None
        if not gateway.settle(core, pending, edit, r.status_code, r.headers, data):
            break
        edit = None
    r.raise_for_status()
    meta = data.get("meta_info", {}) if isinstance(data, dict) else {}
    if not isinstance(data, dict):
        raise httpx.HTTPStatusError("not JSON", request=r.request, response=r)
    return GenerateResult(
        output_ids=list(data.get("output_ids") or []),
        prompt_tokens=int(meta.get("prompt_tokens", len(tokens))),
        cached_tokens=int(meta.get("cached_tokens", 0)),
        e2e_ms=(time.perf_counter() - t0) * 1e3,
        meta=meta,
    )
