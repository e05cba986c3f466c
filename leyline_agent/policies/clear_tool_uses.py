"""``clear_tool_uses``: the oldest tool results are replaced by a placeholder once the prompt is
past a trigger (the analogue of Anthropic's ``clear_tool_uses_20250919`` context edit, which the
proxy's Messages route executes with it; see ``docs/policies.md``).

A tool use is one tool result (``role: "tool"``; one per call, so parallel calls are several).
When the conversation's tokens reach ``trigger_tokens`` (or its tool results
``trigger_tool_uses``), every tool result but the last
``keep`` becomes ``placeholder``, except those of tools named in ``exclude_tools``; when that
would clear fewer than ``clear_at_least`` tokens (new clearings only), nothing new is cleared.
Stable: a result cleared once stays cleared (``Conversation.previous``), so each placeholder is
written once and its KV reused on every later turn. Mode AMORTIZE by default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from leyline_agent.directive import Mode
from leyline_agent.policies.protocol import Conversation, Edit
from leyline_agent.policies.registry import register_policy

REASON = "clear_tool_uses"
PLACEHOLDER = "[tool result cleared]"


def tool_names(messages: list[Mapping[str, Any]] | Any) -> dict[str, str]:
    """Tool-call id → tool name, from the assistant messages' ``tool_calls``."""
    names: dict[str, str] = {}
    for m in messages:
        for call in m.get("tool_calls") or [] if m.get("role") == "assistant" else []:
            fn = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(fn, Mapping) and isinstance(call.get("id"), str):
                names[call["id"]] = str(fn.get("name"))
    return names


@register_policy("clear_tool_uses")
class ClearToolUses(BaseModel):
    """Replace all but the last ``keep`` tool results by a placeholder past ``trigger_tokens``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    trigger_tokens: int = Field(default=100_000, ge=0, description="prompt tokens that trigger")
    trigger_tool_uses: int | None = Field(
        default=None, ge=0, description="tool results that trigger (instead of tokens)"
    )
    keep: int = Field(default=3, ge=0, description="most recent tool results kept verbatim")
    clear_at_least: int = Field(default=0, ge=0, description="fewest tokens a clearing frees")
    exclude_tools: tuple[str, ...] = Field(default=(), description="tools never cleared")
    placeholder: str = PLACEHOLDER
    mode: Mode = Mode.AMORTIZE

    def __call__(self, conversation: Conversation) -> list[Edit]:
        messages = conversation.messages
        names = tool_names(list(messages))
        results = [
            i for i, m in enumerate(messages)
            if m.get("role") == "tool" and names.get(m.get("tool_call_id") or "") not in self.exclude_tools
        ]  # fmt: skip
        done = {e.index for e in conversation.previous if e.reason == REASON}
        chosen = set(done) & set(results)
        count = sum(m.get("role") == "tool" for m in messages)
        if (
            count >= self.trigger_tool_uses
            if self.trigger_tool_uses is not None
            else conversation.total_tokens >= self.trigger_tokens
        ):
            fresh = [i for i in results[: max(0, len(results) - self.keep)] if i not in done]
            freed = sum(conversation.token_counts[i] for i in fresh)
            if fresh and freed >= self.clear_at_least:
                chosen.update(fresh)
        return [
            Edit.model_construct(index=i, span=None, replacement=self.placeholder,
                                 mode=self.mode, reason=REASON, key="content")
            for i in sorted(chosen)
            if conversation.text(i) != self.placeholder
        ]  # fmt: skip
