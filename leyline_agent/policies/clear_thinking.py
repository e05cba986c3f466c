"""``clear_thinking``: the thinking of every assistant message but the last ``keep_last`` that carry
any is cleared (the analogue of Anthropic's ``clear_thinking_20251015`` context edit).

For chat templates that keep earlier thinking in the prompt (Qwen3.8 with ``preserve_thinking``,
Kimi K3, GLM-5.2): an agent's reasoning grows with every step, and the old steps' reasoning is
rarely worth its tokens. An assistant message carries thinking as ``reasoning_content`` (what
clients such as litellm and openai-agents send back) or inline in its content
(``<think>…</think>answer``, or ``…</think>answer`` where the opening tag was the prompt's). The
first becomes ``""`` (the key stays, so the message keeps its shape), the second loses the span
from ``<think>`` (or the start) to the last ``</think>`` and the whitespace after it; whatever the
template then renders for a message without reasoning (nothing, or an empty ``<think></think>``)
is what the server gets.

Stable: the decision depends only on the message's place among the messages with thinking, and a
message cleared once stays cleared (``Conversation.previous``), even when the agent later drops
messages so that it would count among the last ``keep_last`` again. Mode AMORTIZE by default (the
later tokens keep their KV, computed with the thinking in view).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from leyline_agent.directive import Mode
from leyline_agent.policies.protocol import Conversation, Edit
from leyline_agent.policies.registry import register_policy

_OPEN, _CLOSE = "<think>", "</think>"
REASON = "clear_thinking"


def inline_thinking(text: str) -> tuple[int, int] | None:
    """Character span of the thinking inline in ``text`` (see module docstring), or None."""
    close = text.rfind(_CLOSE)
    if close < 0:
        return None
    start = text.find(_OPEN)
    start = start if 0 <= start < close else 0
    end = close + len(_CLOSE)
    while end < len(text) and text[end].isspace():
        end += 1
    return start, end


def has_thinking(message: Mapping[str, Any], text: str) -> bool:
    """An assistant message with a non-empty ``reasoning_content`` or inline thinking."""
    if message.get("role") != "assistant":
        return False
    reasoning = message.get("reasoning_content")
    return bool(isinstance(reasoning, str) and reasoning) or inline_thinking(text) is not None


@register_policy("clear_thinking")
class ClearThinking(BaseModel):
    """Clear the thinking of every assistant message but the last ``keep_last`` that carry any."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    keep_last: int = Field(
        default=1, ge=0, description="assistant messages with thinking whose thinking stays"
    )
    mode: Mode = Mode.AMORTIZE

    def __call__(self, conversation: Conversation) -> list[Edit]:
        thinking = [
            i for i, m in enumerate(conversation.messages) if has_thinking(m, conversation.text(i))
        ]
        kept = set(thinking[len(thinking) - self.keep_last :]) if self.keep_last else set()
        cleared = {e.index for e in conversation.previous if e.reason == REASON}
        edits: list[Edit] = []
        for i in thinking:
            if i in kept and i not in cleared:
                continue
            if conversation.messages[i].get("reasoning_content"):
                edits.append(
                    Edit(
                        index=i,
                        key="reasoning_content",
                        replacement="",
                        mode=self.mode,
                        reason=REASON,
                    )
                )
            span = inline_thinking(conversation.text(i))
            if span is not None:
                edits.append(
                    Edit(index=i, span=span, replacement="", mode=self.mode, reason=REASON)
                )
        return edits
