"""Recorded messages as OpenAI chat messages: ``normalize_message(s)``, ``normalize_tools``.

Kept: ``role``, ``content``, ``tool_calls``, ``tool_call_id``, ``name`` and
``leyline_observation``. Anthropic-format messages (what debug-gym logs for Claude models) become
their OpenAI equivalents: an assistant's ``tool_use`` blocks become ``tool_calls`` and each
``tool_result`` block of a user message becomes a ``role: "tool"`` message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from leyline_agent.messages import OBSERVATION_KEY, content_text, tool_call_arguments

Message = dict[str, Any]


class TraceFormatError(ValueError):
    """A file is not in the format its loader expects."""


def normalize_message(raw: Mapping[str, Any]) -> Message:
    """An OpenAI chat message from a recorded one (framework-specific keys dropped).

    Keeps ``role``, ``content`` (text parts joined with spaces), ``tool_calls`` (arguments as JSON
    strings), ``tool_call_id`` (SWE-agent's ``tool_call_ids[0]``), ``name`` on tool messages, and
    ``leyline_observation``. An assistant's Anthropic ``tool_use`` blocks become ``tool_calls``;
    a message holding ``tool_result`` blocks is more than one message: use ``normalize_messages``.

    Raises:
        TraceFormatError: no role, or ``tool_result`` blocks (see ``normalize_messages``).
    """
    role = raw.get("role")
    if not isinstance(role, str):
        raise TraceFormatError(f"message without a role: {str(raw)[:120]}")
    content = raw.get("content")
    calls = [_tool_call(c) for c in raw.get("tool_calls") or []]
    if isinstance(content, list):
        kinds = {_block_type(b) for b in content}
        unknown = kinds - _BLOCK_TYPES
        if unknown:
            raise TraceFormatError(f"{role} message with unknown content blocks {sorted(unknown)}")
        if "tool_result" in kinds:
            raise TraceFormatError("tool_result blocks: read the list with normalize_messages")
        calls += [_tool_use(b) for b in content if _block_type(b) == "tool_use"]
        texts = [b for b in content if _block_type(b) == "text"]
        content = content_text(texts) if texts or not calls else None
    msg: Message = {"role": role, "content": content}
    if calls:
        msg["tool_calls"] = calls
    if role == "tool":
        call_id = raw.get("tool_call_id") or (raw.get("tool_call_ids") or [None])[0]
        if call_id is not None:
            msg["tool_call_id"] = call_id
        if raw.get("name"):
            msg["name"] = raw["name"]
    if raw.get(OBSERVATION_KEY):
        msg[OBSERVATION_KEY] = True
    return msg


# Anthropic content blocks: ``text`` and ``tool_use`` (assistant), ``tool_result`` (user);
# ``thinking``/``redacted_thinking`` are dropped (Anthropic's API itself drops earlier turns'
# thinking from the prompt); OpenAI's ``text``/``image_url`` parts pass as text parts.
_BLOCK_TYPES = {"text", "tool_use", "tool_result", "thinking", "redacted_thinking"}


def _block_type(block: Any) -> str:
    return "text" if isinstance(block, str) else str(block.get("type", "text"))


def _tool_use(block: Mapping[str, Any]) -> dict[str, Any]:
    return _tool_call(
        {"id": block.get("id"), "name": block.get("name"), "arguments": block.get("input") or {}}
    )


def _result_text(block: Mapping[str, Any]) -> str:
    content = block.get("content")
    if isinstance(content, list):
        return content_text(content)
    return "" if content is None else str(content)


def normalize_messages(
    raws: Sequence[Mapping[str, Any]], tool_names: dict[str, str] | None = None
) -> list[Message]:
    """OpenAI chat messages from a recorded list, Anthropic format included.

    A user message with ``tool_result`` blocks becomes one ``role: "tool"`` message per block, in
    order (``tool_call_id`` = its ``tool_use_id``; ``name`` = the name of the ``tool_use`` with
    that id earlier in the list, when there is one), followed by one ``user`` message with the
    message's other text blocks, if any. Every other message goes through ``normalize_message``.
    ``tool_names``: call id -> tool name of earlier messages (read and extended), for callers that
    normalise a conversation piece by piece.

    Raises:
        TraceFormatError: a message without a role, or with content blocks of an unknown type.
    """
    out: list[Message] = []
    names = {} if tool_names is None else tool_names
    for raw in raws:
        content = raw.get("content")
        if isinstance(content, list) and any(_block_type(b) == "tool_result" for b in content):
            unknown = {_block_type(b) for b in content} - _BLOCK_TYPES
            if unknown:
                raise TraceFormatError(f"message with unknown content blocks {sorted(unknown)}")
            for block in content:
                if _block_type(block) != "tool_result":
                    continue
                call_id = block.get("tool_use_id")
                msg: Message = {"role": "tool", "content": _result_text(block)}
                if call_id is not None:
                    msg["tool_call_id"] = call_id
                    if call_id in names:
                        msg["name"] = names[call_id]
                out.append(msg)
            texts = [b for b in content if _block_type(b) == "text"]
            if texts:
                out.append({"role": raw.get("role", "user"), "content": content_text(texts)})
            continue
        msg = normalize_message(raw)
        for call in msg.get("tool_calls", ()):
            if call.get("id") is not None:
                names[call["id"]] = call["function"]["name"]
        out.append(msg)
    return out


def normalize_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """OpenAI tool schemas; Anthropic ones (``name``, ``description``, ``input_schema``) are
    converted to ``{"type": "function", "function": {name, description, parameters}}``."""
    if not tools:
        return None
    out = []
    for tool in tools:
        if "input_schema" in tool and "function" not in tool:
            fn = {"name": tool.get("name"), "description": tool.get("description", "")}
            out.append({"type": "function", "function": {**fn, "parameters": tool["input_schema"]}})
        else:
            out.append(dict(tool))
    return out


def _tool_call(raw: Mapping[str, Any]) -> dict[str, Any]:
    fn = raw.get("function", raw)
    args = fn.get("arguments", {})
    if not isinstance(args, str):  # a recorded string stays as the agent wrote it
        args = tool_call_arguments({"function": {"arguments": args}}, as_object=False)
    call = {"type": "function", "function": {"name": fn.get("name"), "arguments": args}}
    if raw.get("id") is not None:
        call["id"] = raw["id"]
    return call
