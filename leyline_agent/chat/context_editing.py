"""Anthropic's context editing (``context_management.edits``, beta
``context-management-2025-06-27``) executed as policies, so the edits reach the backend as
splices: ``clear_tool_uses_20250919`` is ``policies.ClearToolUses``, ``clear_thinking_20251015`` is
``policies.ClearThinking`` (``context_policy``); the answer reports what they cleared
(``applied_edits``). Anthropic re-prefills from the first cleared block and bills it as a cache
write; here the KV after it is reused (AMORTIZE), or re-prefilled on request (FORGET).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from leyline_agent.chat.anthropic import MessagesError
from leyline_agent.directive import Mode
from leyline_agent.messages import message_text
from leyline_agent.policies.clear_thinking import REASON as THINKING
from leyline_agent.policies.clear_thinking import ClearThinking
from leyline_agent.policies.clear_tool_uses import REASON as TOOL_USES
from leyline_agent.policies.clear_tool_uses import ClearToolUses
from leyline_agent.policies.protocol import Chain, Edit, Policy

CLEAR_TOOL_USES, CLEAR_THINKING = "clear_tool_uses_20250919", "clear_thinking_20251015"


def _value(config: Any, kind: str, where: str, default: int | None) -> int | None:
    if config is None:
        return default
    if not isinstance(config, Mapping) or config.get("type") != kind:
        raise MessagesError(f"{where}: expected {{'type': '{kind}', 'value': <int>}}")
    value = config.get("value")
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise MessagesError(f"{where}.value: a non-negative integer is required")
    return value


def context_policy(config: Any) -> Policy | None:
    """The policy that executes a request's ``context_management.edits`` (Anthropic's context
    editing): ``clear_tool_uses_20250919`` as ``ClearToolUses`` (``trigger`` in
    ``input_tokens`` or ``tool_uses``, ``keep``, ``clear_at_least``, ``exclude_tools``),
    ``clear_thinking_20251015`` as ``ClearThinking`` (``keep``: ``thinking_turns`` or ``"all"``).
    A Leyline extension, ``"mode": "forget"`` on an edit, executes it as FORGET (default
    AMORTIZE). ``clear_tool_inputs`` is accepted; tool inputs are not cleared. None: no edits.

    Raises:
        MessagesError: an unknown edit type or a malformed parameter.
    """
    if config is None:
        return None
    edits = config.get("edits") if isinstance(config, Mapping) else None
    if not isinstance(edits, list):
        raise MessagesError("context_management.edits: a list of edits is required")
    out: list[Policy] = []
    for k, edit in enumerate(edits):
        where = f"context_management.edits.{k}"
        if not isinstance(edit, Mapping):
            raise MessagesError(f"{where}: an edit must be an object")
        kind = edit.get("type")
        try:
            mode = Mode(edit.get("mode", "amortize"))
        except ValueError as e:
            raise MessagesError(f"{where}.mode: 'amortize' or 'forget'") from e
        if kind == CLEAR_TOOL_USES:
            trigger = edit.get("trigger")
            by_uses = isinstance(trigger, Mapping) and trigger.get("type") == "tool_uses"
            out.append(ClearToolUses(
                trigger_tokens=_value(None if by_uses else trigger, "input_tokens",
                                      f"{where}.trigger", 100_000) or 0,
                trigger_tool_uses=_value(trigger, "tool_uses", f"{where}.trigger", None)
                if by_uses else None,
                keep=_value(edit.get("keep"), "tool_uses", f"{where}.keep", 3) or 0,
                clear_at_least=_value(edit.get("clear_at_least"), "input_tokens",
                                      f"{where}.clear_at_least", 0) or 0,
                exclude_tools=tuple(edit.get("exclude_tools") or ()), mode=mode,
            ))  # fmt: skip
        elif kind == CLEAR_THINKING:
            keep = edit.get("keep")
            if keep == "all" or (isinstance(keep, Mapping) and keep.get("type") == "all"):
                continue
            turns = _value(keep, "thinking_turns", f"{where}.keep", 1) or 0
            out.append(ClearThinking(keep_last=turns, mode=mode))
        else:
            raise MessagesError(f"{where}.type: {kind!r} is not a context edit this proxy runs")
    return Chain(tuple(out)) if out else None


def applied_edits(
    messages: Sequence[Mapping[str, Any]],
    edits: Sequence[Edit],
    count_tokens: Callable[[str], int],
) -> list[dict[str, Any]]:
    """``context_management.applied_edits`` of a turn: per edit type that changed something,
    the blocks cleared and their tokens (the text removed, less the placeholder's)."""
    tools: set[int] = set()
    thinking: set[int] = set()
    tokens = {TOOL_USES: 0, THINKING: 0}
    for e in edits:
        if e.reason not in tokens or e.index >= len(messages):
            continue
        message = messages[e.index]
        if e.key == "reasoning_content":
            removed = str(message.get("reasoning_content") or "")
        else:
            text = message_text(message)
            removed = text if e.span is None else text[e.span[0] : e.span[1]]
        tokens[e.reason] += max(0, count_tokens(removed) - count_tokens(e.replacement or ""))
        (tools if e.reason == TOOL_USES else thinking).add(e.index)
    out = []
    if tools:
        out.append({"type": CLEAR_TOOL_USES, "cleared_tool_uses": len(tools),
                    "cleared_input_tokens": tokens[TOOL_USES]})  # fmt: skip
    if thinking:
        out.append({"type": CLEAR_THINKING, "cleared_thinking_turns": len(thinking),
                    "cleared_input_tokens": tokens[THINKING]})  # fmt: skip
    return out
