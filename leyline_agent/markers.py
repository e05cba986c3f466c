"""Anthropic-style ``cache_control`` markers as pins: which prefixes of a turn's prompt to keep
resident on the backend (``POST /leyline/pin``), and for how long. Pure Python.

A marker is ``"cache_control": {"type": "ephemeral"}`` with an optional ``"ttl"``, on a message,
on one of its content parts, or on a tool definition (at its top level or in its ``function``).
Every marked message is a breakpoint (``cache_markers``): the prompt up to the end of that
message is pinned for that marker's TTL (``DEFAULT_TTL_S`` without one), each breakpoint with its
own TTL; a marked tool is one breakpoint for the tools (``TOOLS``: the prompt up to the end of the
tools' rendering). A message or the tools marked more than once is one breakpoint with the longest
of its TTLs. As Anthropic's API, a request may carry at most ``MAX_BREAKPOINTS`` (4) marked blocks
(``breakpoint_error``: refused with a 400 before any splice). The markers never reach the chat
template (``chat.openai.served_message`` drops them from messages; SGLang's tool model drops them
from tools).

TTLs (``parse_ttl``): ``"<number><unit>"`` with unit ``s``, ``m``, ``h`` or ``d`` (``"5m"``,
``"1h"``, ``"1.5h"``, ``"2d"``), or a bare number, JSON or string, in seconds (``90``,
``"90"``). One above the server's maximum (``MAX_PIN_TTL_S``, 24 h) is clamped to it; a
malformed or non-positive one is ``DEFAULT_TTL_S``. Both come with a ``note`` saying so (the
proxy logs and counts it; the client's request never fails for it).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

from leyline_agent.wire import MAX_PIN_TTL_S

CACHE_CONTROL = "cache_control"
DEFAULT_TTL_S = 300.0  # Anthropic's ephemeral default, "5m"
_TTL = re.compile(r"^\s*([-+]?\d+(?:\.\d*)?|[-+]?\.\d+)\s*([smhd]?)\s*$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
MAX_BREAKPOINTS = 4  # Anthropic's limit on blocks with cache_control in one request
TOOLS = -1  # ``Marker.message`` of a marker on the tool definitions
Marks = Sequence[Sequence[Mapping[str, Any]]] | None  # each message's ``message_marks``, if known
TtlNote = Literal["clamped", "invalid"]


class Ttl(NamedTuple):
    """A marker's TTL in seconds; ``note``: ``clamped`` (above ``MAX_PIN_TTL_S``: the maximum),
    ``invalid`` (malformed or non-positive: ``DEFAULT_TTL_S``), None (as asked, or absent)."""

    seconds: float
    note: TtlNote | None = None


class Marker(NamedTuple):
    """A breakpoint of a request: the marked message's index in the message list (``TOOLS``:
    the tool definitions), the pin's TTL; the marker's ``ttl`` as sent and the ``Ttl.note``
    when it was not taken as it is."""

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


def message_marks(message: Any) -> list[Mapping[str, Any]]:
    """Every ephemeral marker of a message: its own, then its content parts' in order."""
    marks = [m] if (m := _marker(message)) is not None else []
    content = message.get("content") if isinstance(message, Mapping) else None
    if isinstance(content, list):
        marks += [m for part in content if (m := _marker(part)) is not None]
    return marks


def _tool_marks(tools: Any) -> list[Mapping[str, Any]]:
    """Every ephemeral marker of the tool definitions (a tool's own or its ``function``'s)."""
    marks: list[Mapping[str, Any]] = []
    for tool in tools if isinstance(tools, list) else ():
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        marks += [m for m in (_marker(tool), _marker(fn)) if m is not None]
    return marks


def message_marker(message: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The message's own ephemeral marker, else its last content part's that has one."""
    marks = message_marks(message)
    return marks[-1] if marks else None


def _breakpoint(index: int, marks: Sequence[Mapping[str, Any]]) -> Marker:
    """One breakpoint from its markers: the longest TTL (the first one of it)."""
    best: Marker | None = None
    for mark in marks:
        ttl = parse_ttl(mark.get("ttl"))
        if best is None or ttl.seconds > best.ttl_s:
            best = Marker(index, ttl.seconds, mark.get("ttl"), ttl.note)
    assert best is not None
    return best


def marker_count(messages: Sequence[Any], tools: Any = None, marks: Marks = None) -> int:
    """Blocks carrying an ephemeral marker: messages, content parts, tool definitions.
    ``marks``: each message's ``message_marks``, when known."""
    if marks is None:
        marks = [message_marks(m) for m in messages]
    return len(_tool_marks(tools)) + sum(map(len, marks))


def breakpoint_error(messages: Sequence[Any], tools: Any = None, marks: Marks = None) -> str | None:
    """Anthropic's refusal (400) of more than ``MAX_BREAKPOINTS`` marked blocks; None: fine."""
    found = marker_count(messages, tools, marks)
    if found <= MAX_BREAKPOINTS:
        return None
    return (
        f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. Found {found}."
    )


def cache_markers(
    messages: Sequence[Mapping[str, Any]], tools: Any = None, marks: Marks = None
) -> list[Marker]:
    """Every breakpoint, in prompt order: the tools (``TOOLS``) when a tool is marked, then each
    marked message; each with the longest TTL among its markers. ``marks``: each message's
    ``message_marks``, when known."""
    out = [_breakpoint(TOOLS, found)] if (found := _tool_marks(tools)) else []
    if marks is None:
        marks = [message_marks(m) for m in messages]
    out += [_breakpoint(i, found) for i, found in enumerate(marks) if found]
    return out


def cache_marker(messages: Sequence[Mapping[str, Any]]) -> Marker | None:
    """The last message carrying an ephemeral ``cache_control`` marker, with its TTL."""
    found = cache_markers(messages)
    return found[-1] if found else None


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


def tools_end(
    tokens: Sequence[int],
    spans: Sequence[tuple[int, int]],
    tools: Sequence[Any] | None,
    decode: Callable[[Sequence[int]], str],
) -> int:
    """Prompt tokens up to the end of the tools' rendering (a ``TOOLS`` breakpoint): the end of
    the first piece of the prompt, the template's preamble (before ``spans[0]``) then each
    message's span, whose text holds the last tool's name. That is the preamble for a template
    that renders the tools before the first message (the embedded ChatML one without a system
    message: its default system block), the system message for one that renders them inside it
    (ChatML with a system message), the first user message for one that renders them there. 0:
    no tool rendered, or its name found nowhere."""
    last = tools[-1] if tools else None
    fn = last.get("function") if isinstance(last, Mapping) else None
    holder = fn if isinstance(fn, Mapping) else last if isinstance(last, Mapping) else {}
    name = holder.get("name")
    if not isinstance(name, str) or not name or not spans:
        return 0
    for start, stop in [(0, spans[0][0]), *spans]:
        if stop > start and name in decode(tokens[start:stop]):
            return stop
    return 0
