"""Anthropic's context editing through the proxy, executed as splices: the real ``anthropic`` SDK
(``beta.messages.create`` with ``context_management``) against a real proxy and ``leyline
serve``, beside a re-prefill proxy (``splice=False``) on the same requests."""

from __future__ import annotations

import uuid
from typing import Any

import anthropic
import httpx
import pytest
from test_anthropic_messages import ANTHROPIC_TOOLS, GREEDY, as_anthropic
from test_proxy import agent_conversation, serve_proxy

from leyline_agent.chat.anthropic import MessagesError
from leyline_agent.chat.context_editing import context_policy
from leyline_agent.policies import ClearThinking, ClearToolUses

BETA = "context-management-2025-06-27"
# NOTE: keep 2: the result cleared on a turn is followed by one step the backend holds, whose KV a
# splice keeps and a re-prefill recomputes. With keep 1 the result cleared is the last block of
# the cached prompt: there is no KV after it to keep, and both arms read the same.
EDITS = {"edits": [{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": 2},
                    "trigger": {"type": "input_tokens", "value": 700}}]}  # fmt: skip


def test_edits_become_policies_and_bad_ones_a_400() -> None:
    chain = context_policy({"edits": [
        {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 4},
         "keep": {"type": "tool_uses", "value": 2}, "clear_at_least": {"type": "input_tokens", "value": 50},
         "exclude_tools": ["memory"], "mode": "forget"},
        {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}},
        {"type": "clear_thinking_20251015", "keep": "all"},
    ]})  # fmt: skip
    assert chain is not None
    uses, thinking = chain.policies  # type: ignore[attr-defined]
    assert uses == ClearToolUses(trigger_tool_uses=4, keep=2, clear_at_least=50,
                                 exclude_tools=("memory",), mode="forget")  # fmt: skip
    assert thinking == ClearThinking(keep_last=2)
    assert context_policy(None) is None and context_policy({"edits": []}) is None
    for bad in ({"edits": [{"type": "clear_everything"}]}, {"edits": "x"},
                {"edits": [{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": -1}}]}):  # fmt: skip
        with pytest.raises(MessagesError):
            context_policy(bad)


def run(proxy: str, session: str) -> list[Any]:
    c = anthropic.Anthropic(base_url=proxy, api_key="unused", max_retries=0, timeout=120,
                            default_headers={"X-Leyline-Session": session})  # fmt: skip
    out = []
    for messages in agent_conversation()[1:]:  # five turns of the tool loop
        system, msgs = as_anthropic(messages)
        out.append(c.beta.messages.create(
            model="default", max_tokens=1, system=system, messages=msgs, tools=ANTHROPIC_TOOLS,
            betas=[BETA], context_management=EDITS, extra_body=GREEDY,  # type: ignore[arg-type]
        ))  # fmt: skip
    return out


@pytest.mark.sglang
def test_context_editing_is_spliced_and_reported(leyline_server: str) -> None:
    name = f"ctx-{uuid.uuid4().hex[:8]}"
    with (
        serve_proxy(leyline_server, "none") as splice,
        serve_proxy(leyline_server, "none", splice=False) as reprefill,
    ):
        spliced, reprefilled = run(splice, name), run(reprefill, name + "-r")
        records = httpx.get(f"{splice}/leyline/sessions/{name}", timeout=30).json()["records"]
    applied = [m.context_management.applied_edits for m in spliced]
    first = next(t for t, a in enumerate(applied) if a)
    assert 0 < first < len(applied) - 1  # the trigger is crossed mid-loop
    assert all(not a for a in applied[:first])  # nothing to clear: nothing reported
    for t in range(first, len(applied)):
        [edit] = applied[t]
        tool_results = sum(m["role"] == "tool" for m in agent_conversation()[1:][t])
        assert edit.type == "clear_tool_uses_20250919"
        assert edit.cleared_tool_uses == tool_results - 2  # all but the last two tool uses
        assert edit.cleared_input_tokens > 0
        assert records[t]["spliced"] and records[t]["splice_error"] is None
        assert records[t]["directives_amortize"] >= 1
    figures = []
    for t in range(first, len(applied)):
        s, r = spliced[t].usage, reprefilled[t].usage
        total = s.input_tokens + s.cache_read_input_tokens
        assert total == r.input_tokens + r.cache_read_input_tokens  # the same prompt
        figures.append((t, total, s.cache_read_input_tokens, r.cache_read_input_tokens))
        assert s.cache_read_input_tokens >= r.cache_read_input_tokens, figures
        if t > first:  # after the first clearing: at least half of the prompt read from cache;
            # re-prefilled, only the prefix before the newly cleared block, where the splice
            # keeps the step after it too (a step is over 200 tokens)
            assert s.cache_read_input_tokens >= total / 2, figures
            assert s.cache_read_input_tokens - r.cache_read_input_tokens > 200, figures
    print("turn, prompt, cache read (splice), cache read (re-prefill):", figures)
