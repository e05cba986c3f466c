"""One teacher-forced turn through SGLang's ``/generate`` with the rendered token ids (what
``leyline replay`` sends): the token-level front door beside ``chat_turn.py``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from leyline_agent.accounting import TurnRecord
from leyline_agent.client import GenerateResult
from leyline_agent.session import SessionCore


def generate_turn(
    core: SessionCore,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None = None,
    *,
    max_new_tokens: int = 1,
) -> tuple[TurnRecord, GenerateResult]:
    """Plan and splice (``SessionCore.begin``), send ``plan.tokens`` to ``/generate`` in the
    session's request namespace (greedy, ``max_new_tokens``), record the turn. Raises
    ``httpx.HTTPError`` as ``LeylineClient.generate``; ``PolicyError``, ``DirectiveError`` as
    ``SessionCore.plan``."""
    pending = core.begin(messages, tools)
    where = core.placement
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
