"""Anthropic-style ``cache_control`` markers as pins: which prefix of a turn's prompt to keep
resident on the backend (``POST /leyline/pin``), and for how long. Pure Python.

A marker is ``"cache_control": {"type": "ephemeral"}`` with an optional ``"ttl"``, on a message
or on one of its content parts. A turn pins one prefix: the prompt up to the end of the last
marked message, for that marker's TTL (``DEFAULT_TTL_S`` without one). The markers never reach
the chat template (``chat.openai.served_message`` drops them).

TTLs (``parse_ttl``): ``"<number><unit>"`` with unit ``s``, ``m``, ``h`` or ``d`` (``"5m"``,
``"1h"``, ``"1.5h"``, ``"2d"``), or a bare number, JSON or string, in seconds (``90``,
``"90"``). One above the server's maximum (``MAX_PIN_TTL_S``, 24 h) is clamped to it; a
malformed or non-positive one is ``DEFAULT_TTL_S``. Both come with a ``note`` saying so (the
proxy logs and counts it; the client's request never fails for it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

from leyline_agent.wire import MAX_PIN_TTL_S

CACHE_CONTROL = "cache_control"
DEFAULT_TTL_S = 300.0  # Anthropic's ephemeral default, "5m"
_TTL = re.compile(r"^\s*([-+]?\d+(?:\.\d*)?|[-+]?\.\d+)\s*([smhd]?)\s*$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
TtlNote = Literal["clamped", "invalid"]


class Ttl(NamedTuple):
    """A marker's TTL in seconds; ``note``: ``clamped`` (above ``MAX_PIN_TTL_S``: the maximum),
    ``invalid`` (malformed or non-positive: ``DEFAULT_TTL_S``), None (as asked, or absent)."""

    seconds: float
    note: TtlNote | None = None


class Marker(NamedTuple):
    """The last marked message of a request: its index in the message list, the pin's TTL; the
    marker's ``ttl`` as sent and the ``Ttl.note`` when it was not taken as it is."""

    message: int
    ttl_s: float
    ttl: Any = None
    ttl_note: TtlNote | None = None


def parse_ttl(value: Any) -> Ttl:
    """A marker's ``ttl`` (module docstring): ``"5m"`` -> 300 s, ``"1h"`` -> 3600 s, ``90`` or
    ``"90"`` -> 90 s, ``"25h"`` -> 86400 s clamped, ``"abc"`` or ``"0s"`` -> ``DEFAULT_TTL_S``
    invalid, None (absent) -> ``DEFAULT_TTL_S``."""
    if value is None:
        return Ttl(DEFAULT_TTL_S)
    seconds: float | None = None
    if isinstance(value, bool):
        pass
    elif isinstance(value, int):
        seconds = float(max(-1, min(value, 2 * int(MAX_PIN_TTL_S))))  # NOTE: no OverflowError
    elif isinstance(value, float):
        seconds = value
    elif isinstance(value, str) and (m := _TTL.match(value)):
        seconds = float(m.group(1)) * _UNIT_S[m.group(2)]  # NOTE: inf when past float's range
    if seconds is None or math.isnan(seconds) or seconds <= 0:
        return Ttl(DEFAULT_TTL_S, "invalid")
    if seconds > MAX_PIN_TTL_S:
        return Ttl(MAX_PIN_TTL_S, "clamped")
    return Ttl(seconds)


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
            ttl = parse_ttl(mark.get("ttl"))
            return Marker(i, ttl.seconds, mark.get("ttl"), ttl.note)
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
