"""The OpenAI Responses API as views of the chat turn: a ``POST /v1/responses`` body as a chat
completions body (``chat_body``, the request view) and a chat completion as a ``Response``
object (``response_object``, the response view). Pure Python; the proxy's route is
``proxy/openai_responses.py``.

Input items → chat messages (the conversation model policies and the diff already use):

===========================================  =================================================
``"hi"`` (a string)                          ``{"role": "user", "content": "hi"}``
``{"type": "message", "role", "content"}``   the same role; ``input_text``/``output_text``
                                             parts joined into the message's text
``{"type": "function_call", ...}``           an assistant ``tool_calls`` entry (consecutive
                                             calls in one assistant message)
``{"type": "function_call_output", ...}``    ``{"role": "tool", "tool_call_id", "content"}``
``{"type": "reasoning", "summary", ...}``    ``reasoning_content`` of the next assistant message
``instructions``                             a leading system message (not carried along a
                                             ``previous_response_id`` chain, as OpenAI's API)
===========================================  =================================================

Source: the OpenAI API reference for ``responses.create`` (openai-python 2.8
``types/responses``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

Message = dict[str, Any]
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
# NOTE: the Responses fields with no chat counterpart (or another meaning there); every other field
# of the request (temperature, top_p, user, cache_salt, SGLang's ebnf/regex, ...) is sent on as is.
RESPONSES_ONLY = frozenset({
    "input", "instructions", "tools", "tool_choice", "max_output_tokens", "previous_response_id",
    "store", "metadata", "text", "truncation", "include", "reasoning", "background",
    "conversation", "prompt", "prompt_cache_retention", "service_tier", "safety_identifier",
    "top_logprobs", "max_tool_calls", "stream_options", "model", "messages",
})  # fmt: skip


class ResponsesError(ValueError):
    """A request the Responses API refuses (400): the message and the offending ``param``."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def new_id(prefix: str) -> str:
    """An id in OpenAI's shape (``resp_…``, ``msg_…``, ``fc_…``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ResponsesError(f"{where}.content must be a string or a list of parts", where)
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ResponsesError(
                f"{where}.content[{k}]: only text parts are served (type {kind!r})",
                f"{where}.content[{k}]",
            )
        texts.append(part["text"])
    return "".join(texts)


def input_messages(items: Any) -> list[Message]:
    """The chat messages of a request's ``input`` (module table).

    Raises:
        ResponsesError: an item of an unknown type, or malformed.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise ResponsesError("'input' must be a string or a list of items", "input")
    out: list[Message] = []
    reasoning: str | None = None
    for k, item in enumerate(items):
        where = f"input[{k}]"
        if not isinstance(item, Mapping):
            raise ResponsesError(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ResponsesError(f"{where}.role must be user, assistant, system or developer", where)  # fmt: skip
            message: Message = {"role": role, "content": _text(item.get("content"), where)}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            out.append(message)
        elif kind == "function_call":
            if not isinstance(item.get("name"), str):
                raise ResponsesError(f"{where}.name must be a string", where)
            call = {
                "id": item.get("call_id") or item.get("id") or new_id("call"),
                "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant" and reasoning is None:
                last["tool_calls"] = [call]
            else:
                message = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning is not None:
                    message["reasoning_content"], reasoning = reasoning, None
                out.append(message)
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, where)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        elif kind == "reasoning":
            parts = [*(item.get("summary") or []), *(item.get("content") or [])]
            reasoning = _text(parts, where) if parts else ""
        else:
            raise ResponsesError(f"{where}: items of type {kind!r} are not served", where)
    return out


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Function tools as chat tools. Raises ``ResponsesError`` for other tool types."""
    if not tools:
        return None
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else None
            raise ResponsesError(f"tools[{k}]: only function tools are served (type {kind!r})", f"tools[{k}]")  # fmt: skip
        fn = {k2: tool[k2] for k2 in ("name", "description", "parameters") if k2 in tool}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """``tool_choice`` in the chat API's shape (a named function becomes
    ``{"type": "function", "function": {"name": ...}}``)."""
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def chat_body(
    body: Mapping[str, Any], history: Sequence[Message] = ()
) -> tuple[dict[str, Any], list[Message]]:
    """``(the chat completions body, the conversation)`` of a Responses request: ``history``
    (a stored response's conversation, for ``previous_response_id``) then this request's input,
    after ``instructions`` as a system message. The conversation (without the instructions) is
    what a stored response keeps. Raises ``ResponsesError``."""
    if not isinstance(body, Mapping):
        raise ResponsesError("the request body must be a JSON object")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ResponsesError("'instructions' must be a string", "instructions")
    conversation = [*(dict(m) for m in history), *input_messages(body.get("input", []))]
    if not conversation:
        raise ResponsesError("'input' must not be empty", "input")
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat: dict[str, Any] = {"model": body.get("model") or "default"}
    chat["messages"] = [*system, *conversation]
    tools = chat_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    chat.update({k: v for k, v in body.items() if k not in RESPONSES_ONLY and v is not None})
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    return chat, conversation


def usage_of(usage: Mapping[str, Any] | None) -> dict[str, Any]:
    """Chat ``usage`` as the Responses API reports it."""
    usage = usage or {}
    prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def output_items(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A chat completion's assistant message as Responses output items: a ``message`` with one
    ``output_text`` part (when it has text), then one ``function_call`` per tool call."""
    items: list[dict[str, Any]] = []
    text = message.get("content") or ""
    if text or not message.get("tool_calls"):
        part: dict[str, Any] = {
            "type": "output_text",
            "text": text,
            "annotations": [],
            "logprobs": [],
        }
        items.append({"type": "message", "id": new_id("msg"), "status": "completed",
                      "role": "assistant", "content": [part]})  # fmt: skip
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        items.append({"type": "function_call", "id": new_id("fc"), "status": "completed",
                      "call_id": call.get("id") or new_id("call"), "name": fn.get("name"),
                      "arguments": fn.get("arguments") or ""})  # fmt: skip
    return items


def answer_message(items: Sequence[Mapping[str, Any]]) -> Message:
    """The output items as the assistant chat message the conversation continues with."""
    text = "".join(p.get("text", "") for i in items if i["type"] == "message" for p in i["content"])
    message: Message = {"role": "assistant", "content": text}
    calls = [
        {"id": i["call_id"], "type": "function",
         "function": {"name": i["name"], "arguments": i["arguments"]}}
        for i in items if i["type"] == "function_call"
    ]  # fmt: skip
    if calls:
        message["tool_calls"] = calls
    return message


def response_object(
    body: Mapping[str, Any],
    response_id: str,
    output: list[dict[str, Any]],
    usage: Mapping[str, Any] | None,
    *,
    finish_reason: str | None = "stop",
    status: str = "completed",
) -> dict[str, Any]:
    """A ``Response`` (``object: "response"``) for ``body``'s request with ``output``; status
    ``incomplete`` (reason ``max_output_tokens``) when the generation hit its length limit."""
    incomplete = status == "completed" and finish_reason == "length"
    return {
        "id": response_id,
        "object": "response",
        "created_at": time.time(),
        "status": "incomplete" if incomplete else status,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": body.get("model") or "default",
        "instructions": body.get("instructions"),
        "output": output,
        "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": list(body.get("tools") or []),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": body.get("previous_response_id"),
        "store": body.get("store", True) is not False,
        "metadata": body.get("metadata") or {},
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "usage": usage_of(usage) if usage is not None else None,
    }
