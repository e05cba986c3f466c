"""Anthropic's Messages API as views of the chat turn: a ``POST /v1/messages`` body as a chat
completions body (``chat_body``, the request view) and a chat completion as a Messages answer
(``message_object``, the response view). Pure Python; the proxy's route is
``proxy/anthropic_messages.py``.

Blocks → chat messages (the conversation model policies and the diff already use):

==========================================  ==================================================
``system`` (a string or text blocks)        a leading system message
user ``text`` blocks                        one user message (text joined)
user ``tool_result`` blocks                 ``{"role": "tool", "tool_call_id", "content"}``, in
                                            order, before the user's text
assistant ``text`` / ``tool_use``           one assistant message: ``content``, ``tool_calls``
                                            (``input`` as JSON ``arguments``)
assistant ``thinking``                      its ``reasoning_content``
``redacted_thinking``                       dropped (opaque to any other model)
``cache_control`` on a block                on the message it became (a pin, ``markers.py``)
``image`` / ``document``                    400 (the backend serves text only)
==========================================  ==================================================

Usage as Anthropic reports it: ``cache_read_input_tokens`` are the prompt tokens the backend
found cached; ``cache_creation_input_tokens`` the rest of the prompt up to the last
``cache_control`` breakpoint (prefilled and kept, as Anthropic's cache write);
``input_tokens`` the rest after it. Source: Anthropic's Messages API reference.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from leyline_agent.markers import parse_ttl

Message = dict[str, Any]
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
NOT_SERVED = ("image", "document", "search_result", "server_tool_use", "web_search_tool_result")


class MessagesError(ValueError):
    """A request the Messages API refuses (400, ``invalid_request_error``)."""


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _blocks(content: Any, where: str) -> list[Mapping[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise MessagesError(f"{where}.content: must be a string or a list of content blocks")
    for k, block in enumerate(content):
        if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
            raise MessagesError(f"{where}.content.{k}: a content block must be an object with a type")  # fmt: skip
        if block["type"] in NOT_SERVED:
            raise MessagesError(f"{where}.content.{k}: {block['type']} blocks are not served by this backend (text only)")  # fmt: skip
    return content


def _text_of(content: Any, where: str) -> str:
    texts = []
    for k, block in enumerate(_blocks(content, where)):
        if block["type"] != "text" or not isinstance(block.get("text"), str):
            raise MessagesError(f"{where}.content.{k}: expected a text block, got {block['type']}")
        texts.append(block["text"])
    return "".join(texts)


def _marked(message: Message, block: Mapping[str, Any]) -> Message:
    """``message`` with ``block``'s ``cache_control`` marker; of several blocks' markers in one
    message, the one with the longest TTL (each breakpoint keeps its TTL: ``markers.py``)."""
    mark = block.get("cache_control")
    if isinstance(mark, Mapping):
        old = message.get("cache_control")
        if (
            not isinstance(old, Mapping)
            or parse_ttl(mark.get("ttl")).seconds >= parse_ttl(old.get("ttl")).seconds
        ):
            message["cache_control"] = dict(mark)
    return message


def user_messages(content: Any, where: str) -> list[Message]:
    """A user turn: its tool results (tool messages) in order, then its text (a user message)."""
    out: list[Message] = []
    text: Message | None = None
    for k, block in enumerate(_blocks(content, where)):
        kind = block["type"]
        if kind == "tool_result":
            result = block.get("content")
            body = (
                result
                if isinstance(result, str)
                else _text_of(result or [], f"{where}.content.{k}")
            )
            tool = {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": body}
            out.append(_marked(tool, block))
        elif kind == "text":
            text = text or {"role": "user", "content": ""}
            text["content"] += block.get("text") or ""
            _marked(text, block)
        else:
            raise MessagesError(f"{where}.content.{k}: {kind} blocks are not valid in a user turn")
    return [*out, *([text] if text is not None else [])]


def assistant_message(content: Any, where: str) -> Message:
    """An assistant turn as one chat message."""
    message: Message = {"role": "assistant", "content": ""}
    for k, block in enumerate(_blocks(content, where)):
        kind = block["type"]
        if kind == "text":
            message["content"] += block.get("text") or ""
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            call = {"id": block.get("id"), "type": "function",
                    "function": {"name": block.get("name"), "arguments": arguments}}  # fmt: skip
            message.setdefault("tool_calls", []).append(call)
        elif kind == "thinking":
            message["reasoning_content"] = message.get("reasoning_content", "") + (
                block.get("thinking") or ""
            )
        elif kind != "redacted_thinking":
            raise MessagesError(f"{where}.content.{k}: {kind} blocks are not valid in an assistant turn")  # fmt: skip
        _marked(message, block)
    return message


def chat_messages(body: Mapping[str, Any]) -> list[Message]:
    """``system`` and ``messages`` as chat messages (module table). Raises ``MessagesError``."""
    out: list[Message] = []
    system = body.get("system")
    if system:
        message: Message = {"role": "system", "content": _text_of(system, "system")}
        for block in system if isinstance(system, list) else []:
            _marked(message, block)
        out.append(message)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise MessagesError("messages: at least one message is required")
    for k, m in enumerate(messages):
        where = f"messages.{k}"
        role = m.get("role") if isinstance(m, Mapping) else None
        if role == "user":
            out.extend(user_messages(m.get("content"), where))
        elif role == "system":  # NOTE: mid-conversation system text (Claude Code 2.1)
            message = {"role": "system", "content": _text_of(m.get("content"), where)}
            for block in m.get("content") if isinstance(m.get("content"), list) else []:
                _marked(message, block)
            out.append(message)
        elif role == "assistant":
            out.append(assistant_message(m.get("content"), where))
        else:
            raise MessagesError(f"{where}.role: must be 'user', 'assistant' or 'system'")
    return out


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Client tools (``name``, ``description``, ``input_schema``) as chat tools; a
    ``cache_control`` on a tool is kept on it. Server tools are refused."""
    if not tools:
        return None
    out = []
    for k, tool in enumerate(tools):
        if (
            not isinstance(tool, Mapping)
            or tool.get("type", "custom") != "custom"
            or ("input_schema" not in tool)
        ):
            raise MessagesError(f"tools.{k}: only client tools with an input_schema are served")
        fn = {"name": tool.get("name"), "description": tool.get("description", ""),
              "parameters": tool["input_schema"]}  # fmt: skip
        chat_tool: dict[str, Any] = {"type": "function", "function": fn}
        if isinstance(tool.get("cache_control"), Mapping):  # a breakpoint (markers.py)
            chat_tool["cache_control"] = dict(tool["cache_control"])
        out.append(chat_tool)
    return out


def chat_tool_choice(choice: Any) -> tuple[Any, bool | None]:
    """``(the chat tool_choice, parallel_tool_calls)`` of Anthropic's ``tool_choice``."""
    if not isinstance(choice, Mapping):
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}.get(kind or "", None), parallel


def chat_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat completions body of a Messages request. Raises ``MessagesError``."""
    if not isinstance(body, Mapping):
        raise MessagesError("the request body must be a JSON object")
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise MessagesError("max_tokens: a positive integer is required")
    chat: dict[str, Any] = {"model": body.get("model") or "default",
                            "messages": chat_messages(body), "max_tokens": max_tokens}  # fmt: skip
    tools = chat_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    choice, parallel = chat_tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    if parallel is not None:
        chat["parallel_tool_calls"] = parallel
    for name in ("temperature", "top_p", "top_k", "stream"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stop_sequences"):
        chat["stop"] = list(body["stop_sequences"])
    user = (body.get("metadata") or {}).get("user_id")
    if isinstance(user, str) and user:
        chat["user"] = user  # an end user's scope (identity.session_keys)
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    return chat


def anthropic_usage(usage: Mapping[str, Any] | None, marked_end: int = 0) -> dict[str, int]:
    """Chat ``usage`` as Anthropic's (module docstring); ``marked_end``: the prompt tokens up to
    the last ``cache_control`` breakpoint (0: none)."""
    usage = usage or {}
    prompt = int(usage.get("prompt_tokens", 0))
    read = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    creation = max(0, min(marked_end, prompt) - read)
    return {
        "input_tokens": prompt - read - creation,
        "cache_creation_input_tokens": creation,
        "cache_read_input_tokens": read,
        "output_tokens": int(usage.get("completion_tokens", 0)),
    }


def content_blocks(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A chat completion's assistant message as Anthropic content blocks."""
    blocks: list[dict[str, Any]] = []
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        try:
            arguments = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            arguments = {"_raw": fn.get("arguments")}  # NOTE: the model wrote no JSON object
        if not isinstance(arguments, dict):
            arguments = {"_raw": arguments}
        blocks.append({"type": "tool_use", "id": call.get("id") or new_id("toolu"),
                       "name": fn.get("name"), "input": arguments})  # fmt: skip
    return blocks


def message_object(
    model: str,
    content: list[dict[str, Any]],
    finish_reason: str | None,
    usage: dict[str, int],
    message_id: str | None = None,
) -> dict[str, Any]:
    """A Messages answer (``type: "message"``)."""
    stop = STOP_REASONS.get(finish_reason or "stop", "end_turn")
    if any(b["type"] == "tool_use" for b in content):
        stop = "tool_use"
    return {"id": message_id or new_id("msg"), "type": "message", "role": "assistant",
            "model": model, "content": content, "stop_reason": stop, "stop_sequence": None,
            "usage": usage}  # fmt: skip


def error_body(kind: str, message: str) -> dict[str, Any]:
    """Anthropic's error format."""
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_kind(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
            529: "overloaded_error"}.get(status, "api_error")  # fmt: skip
