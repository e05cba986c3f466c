"""SGLang's chat-endpoint normalisation of messages and tools, mirrored without importing SGLang.

SGLang (0.5.x ``serving_chat``) does not hand the client's messages to the chat template as sent;
the renderer applies the same steps so that its tokens equal the server's. Checked against SGLang
itself in ``tests/test_render.py`` where the sglang extra is installed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from leyline_agent.messages import content_text, is_text_parts, served_content, tool_call_arguments

_FUNCTION_FIELDS = ("description", "name", "parameters", "strict", "defer_loading")


def _sglang_tool_call(call: Any) -> Any:
    if not isinstance(call, dict):
        return call
    fn = call.get("function") or {}
    return {
        "id": call.get("id"),
        "index": call.get("index"),
        "type": call.get("type", "function"),
        "function": {"name": fn.get("name"), "arguments": tool_call_arguments(call, True)},
    }


def sglang_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as SGLang's chat endpoint hands them to the chat template.

    Mirrors ``serving_chat`` (sglang 0.5.x): assistant tool-call ``arguments`` given as JSON
    strings are parsed into objects (so ``tojson`` re-serialises them), ``content: None``
    becomes ``""``, top-level keys whose value is ``None`` are dropped, a tool message's
    list of text parts is joined with spaces, and a user message keeps only ``role`` and
    ``content`` (SGLang's user-message model has no other field: ``name`` is dropped).
    """
    out = []
    for message in messages:
        m = dict(message)
        if m.get("role") == "user":
            m = {"role": "user", "content": m.get("content")}
        if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            m["tool_calls"] = [_sglang_tool_call(c) for c in m["tool_calls"]]
        m["content"] = served_content(m)
        if m.get("role") == "tool" and is_text_parts(m["content"]):
            m["content"] = content_text(m["content"])
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def sglang_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]] | None:
    """Tool schemas as SGLang hands them to the chat template (``Tool.model_dump()``).

    ``{"type", "function", "defer_loading"}`` at the top; inside ``function`` the keys the
    client sent keep their order, the missing ones of ``description``/``name``/``parameters``
    follow as ``None``, ``strict``/``defer_loading`` only when set; unknown keys are dropped.
    """
    if not tools:
        return None
    out = []
    for tool in tools:
        if not isinstance(tool, dict):
            out.append(tool)
            continue
        fn_in = tool.get("function") or {}
        defer = tool.get("defer_loading")
        data = {k: fn_in.get(k) for k in _FUNCTION_FIELDS}
        if defer is not None and data["defer_loading"] is None:
            data["defer_loading"] = defer
        for optional in ("strict", "defer_loading"):
            if data[optional] is None:
                data.pop(optional)
        order = [k for k in fn_in if k in data]
        fn = {k: data[k] for k in order + [k for k in data if k not in order]}
        out.append({"type": tool.get("type", "function"), "function": fn, "defer_loading": defer})
    return out
