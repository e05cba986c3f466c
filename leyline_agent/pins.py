"""Anthropic-style ``cache_control`` markers as pins: which prefix of a turn's prompt to keep
resident on the backend (``POST /leyline/pin``), and for how long. Pure Python.

A marker is ``"cache_control": {"type": "ephemeral"}`` with an optional ``"ttl"`` (``"5m"``,
``"1h"``; any ``<number>s|m|h``), on a message or on one of its content parts. A turn pins one
prefix: the prompt up to the end of the last marked message, for that marker's TTL
(``DEFAULT_TTL_S`` without one). The markers never reach the chat template
(``chat.openai.served_message`` drops them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from leyline_agent.backends.sglang.wire import MAX_PIN_TTL_S

CACHE_CONTROL = "cache_control"
DEFAULT_TTL_S = 300.0  # Anthropic's ephemeral default, "5m"
_TTL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smh])\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}


class Marker(NamedTuple):
    """The last marked message of a request: its index in the message list, the pin's TTL."""

    message: int
    ttl_s: float


def parse_ttl(value: Any) -> float:
    """A marker's ``ttl`` in seconds: ``"5m"`` -> 300, ``"1h"`` -> 3600, a number as seconds;
    anything else (absent, malformed, outside (0, 86400]) is ``DEFAULT_TTL_S``."""
    seconds: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (m := _TTL.match(value)):
        seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    if seconds is None or not 0 < seconds <= MAX_PIN_TTL_S:
        return DEFAULT_TTL_S
    return seconds


def _marker(holder: Any) -> Mapping[str, Any] | None:
    mark = holder.get(CACHE_CONTROL) if isinstance(holder, Mapping) else None
    return mark if isinstance(mark, Mapping) and mark.get("type") == "ephemeral" else None


def message_marker(message: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The message's own ephemeral marker, else its last content part's that has one."""
    found = _marker(message)
    content = message.get("content")
    if isinstance(content, list):
        for part in content:
            found = _marker(part) or found
    return found


def cache_marker(messages: Sequence[Mapping[str, Any]]) -> Marker | None:
    """The last message carrying an ephemeral ``cache_control`` marker, with its TTL."""
    for i in range(len(messages) - 1, -1, -1):
        mark = message_marker(messages[i])
        if mark is not None:
            return Marker(i, parse_ttl(mark.get("ttl")))
    return None


def strip_markers(message: Mapping[str, Any]) -> dict[str, Any]:
    """``message`` without ``cache_control`` (on it and on its content parts)."""
    out = {k: v for k, v in message.items() if k != CACHE_CONTROL}
    content = out.get("content")
    if isinstance(content, list) and any(
        isinstance(p, Mapping) and CACHE_CONTROL in p for p in content
    ):
        out["content"] = [
            {k: v for k, v in p.items() if k != CACHE_CONTROL} if isinstance(p, Mapping) else p
            for p in content
        ]
    return out


def marked_end(spans: Sequence[tuple[int, int]], sources: Sequence[int], index: int) -> int:
    """Prompt tokens up to the end of incoming message ``index``: the end of the last sent
    message (``spans[j]``, from incoming ``sources[j]``) at or before it; 0 when none is (the
    policy dropped everything up to it)."""
    end = 0
    for (_, stop), source in zip(spans, sources, strict=False):
        if source <= index:
            end = stop
    return end
