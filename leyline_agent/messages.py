"""What a message is: the OpenAI chat-message vocabulary every part of the agent side shares.

A message is a mapping with ``role`` and ``content`` (a string, a list of parts, or ``None``),
optionally ``tool_calls`` (each ``{"id", "type", "function": {"name", "arguments"}}``),
``tool_call_id`` and ``name``. Pure Python; used by the policies, the renderer, the wrapper, the
request views in ``chat/`` and the trace loaders, so that each normalises a message the same way.

- text parts are ``str`` parts or ``{"type": "text", "text": ...}``; their text is joined with
  single spaces, as SGLang joins them for string-content chat templates;
- ``content: None`` reads as ``""``;
- tool-call arguments are JSON objects, kept as a string (``json.dumps(..., ensure_ascii=False)``,
  what chat templates' ``tojson`` writes) or parsed into a ``dict``.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

OBSERVATION_KEY = "leyline_observation"
TEXT_TYPES = ("text",)


def is_observation(message: Mapping[str, Any]) -> bool:
    """Whether ``message`` is an environment observation: ``role: "tool"``, or a plain message
    flagged with ``"leyline_observation": True`` (text-based agents; the trace loaders set it)."""
    return message.get("role") == "tool" or bool(message.get(OBSERVATION_KEY))


def is_text_part(part: Any, types: Collection[str] = TEXT_TYPES) -> bool:
    """A ``str`` part, or a part object whose ``type`` is one of ``types``."""
    return isinstance(part, str) or (isinstance(part, Mapping) and part.get("type") in types)


def is_text_parts(content: Any, types: Collection[str] = TEXT_TYPES) -> bool:
    """``content`` is a list of text parts only (see ``is_text_part``)."""
    return isinstance(content, list) and all(is_text_part(p, types) for p in content)


def content_text(content: Any, types: Collection[str] = TEXT_TYPES) -> str:
    """Content as one string: ``None`` -> ``""``, a string as is, a list's text parts joined with
    spaces (other parts skipped)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return " ".join(
        p if isinstance(p, str) else str(p.get("text", ""))
        for p in content
        if is_text_part(p, types)
    )


def message_text(message: Mapping[str, Any]) -> str:
    """A message's content as one string (see ``content_text``)."""
    return content_text(message.get("content"))


def sent_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """The message as the wrapper sends it: ``leyline_*`` annotations removed, a list of text
    parts joined into one string (so that the server and the wrapper cannot join them
    differently)."""
    out = dict(message)
    for k in [k for k in out if k.startswith("leyline_")]:
        del out[k]
    if type(out.get("content")) is not str and is_text_parts(out.get("content")):
        out["content"] = message_text(out)
    return out


def served_content(message: Mapping[str, Any]) -> Any:
    """The content as a chat endpoint reads it: ``None`` (or absent) -> ``""``, else as is."""
    content = message.get("content")
    return "" if content is None else content


def tool_call_arguments(call: Mapping[str, Any], as_object: bool) -> Any:
    """A tool call's ``function.arguments``.

    ``as_object``: a JSON string holding an object is parsed into a ``dict``; anything else is
    returned as it is. Otherwise a JSON string: an object (given, or parsed from a string) is
    serialised with ``ensure_ascii=False``; a string that holds no JSON object is returned as it
    is (a server refuses it; the agent's text is kept); any other value is serialised.
    """
    fn = call.get("function")
    args = fn.get("arguments") if isinstance(fn, Mapping) else None
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            return args
        if not isinstance(parsed, dict):
            return args
        args = parsed
    if as_object:
        return args
    return json.dumps(args, ensure_ascii=False)


def flatten(messages: Sequence[Mapping[str, Any]], cap_chars: int) -> list[dict[str, Any]]:
    """Plain-text messages for a template without tool support, each cut to ``cap_chars``
    characters: content as one string (``message_text``), an assistant's tool calls appended as
    ``<tool_call>{"name", "arguments"}</tool_call>`` (JSON), then the first ``cap_chars``
    characters kept (the head); roles kept (``tool`` included), and ``tool_call_id``, ``name`` and
    the observation flag kept for the policies. The cut ``leyline bench fidelity --cap-chars`` and
    ``leyline replay --cap-chars`` make: the same message cuts the same way in every turn, so a
    trace's turns stay prefixes of each other. Raises ``ValueError`` if ``cap_chars < 1``."""
    if cap_chars < 1:
        raise ValueError(f"cap_chars must be >= 1, got {cap_chars}")
    out = []
    for m in messages:
        text = message_text(m) or ""
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {})
            body = {"name": fn.get("name"), "arguments": fn.get("arguments")}
            text += f"\n<tool_call>{json.dumps(body)}</tool_call>"
        flat = {"role": m.get("role", "user"), "content": text[:cap_chars]}
        for k in ("tool_call_id", "name", OBSERVATION_KEY):
            if k in m:
                flat[k] = m[k]
        out.append(flat)
    return out
