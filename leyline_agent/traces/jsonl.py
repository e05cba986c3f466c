"""JSONL of OpenAI chat messages. One file is one trace; two line shapes (not mixed in a file):

1. One request per line: a JSON list of messages, or ``{"messages": [...], "tools": [...]}``.
   Each line is one turn, as sent.
2. One message per line: ``{"role": ..., "content": ..., ...}``, the conversation in order.
   If the messages carry an integer ``"turn"`` key (the turn in which the message was first sent),
   turn ``t`` is every message with ``turn <= t``; otherwise each assistant message ends a turn
   (the request for it is every message before it). A line ``{"tools": [...]}`` (no ``role``) sets
   the tools.

Observations are ``role: "tool"`` messages or messages with ``"leyline_observation": true``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from leyline_agent.traces import (
    Trace,
    TraceFormatError,
    normalize_messages,
    normalize_tools,
    turns_at_assistant,
)


def _lines(path: Path) -> list[tuple[int, Any]]:
    out = []
    for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((no, json.loads(line)))
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{path}:{no}: not JSON ({e})") from e
    return out


def load(path: str | Path) -> list[Trace]:
    path = Path(path)
    lines = _lines(path)
    if not lines:
        return []
    per_request = [
        isinstance(v, list) or (isinstance(v, dict) and "messages" in v) for _, v in lines
    ]
    if all(per_request):
        return [_per_request(path, lines)]
    if any(per_request):
        no = lines[per_request.index(not per_request[0])][0]
        raise TraceFormatError(f"{path}:{no}: mixes request lines and message lines")
    return [_per_message(path, lines)]


def _per_request(path: Path, lines: list[tuple[int, Any]]) -> Trace:
    turns, tools = [], None
    for no, value in lines:
        messages = value if isinstance(value, list) else value["messages"]
        if not isinstance(messages, list):
            raise TraceFormatError(f"{path}:{no}: 'messages' is not a list")
        turns.append(normalize_messages(messages))
        if isinstance(value, dict) and value.get("tools"):
            tools = normalize_tools(value["tools"])
    return Trace(path.stem, turns, tools, str(path))


def _per_message(path: Path, lines: list[tuple[int, Any]]) -> Trace:
    messages, turn_of, tools = [], [], None
    names: dict[str, str] = {}
    for no, value in lines:
        if not isinstance(value, dict):
            raise TraceFormatError(f"{path}:{no}: expected a message object")
        if "role" not in value and "tools" in value:
            tools = normalize_tools(value["tools"])
            continue
        try:
            expanded = normalize_messages([value], names)
        except TraceFormatError as e:
            raise TraceFormatError(f"{path}:{no}: {e}") from e
        turn = value.get("turn")
        if turn is not None and not isinstance(turn, int):
            raise TraceFormatError(f"{path}:{no}: 'turn' must be an integer")
        messages += expanded
        turn_of += [turn] * len(expanded)
    numbered = [t for t in turn_of if t is not None]
    if numbered:
        if len(numbered) < len(turn_of):
            raise TraceFormatError(f"{path}: some messages have a 'turn' key and some do not")
        turns = [
            [m for m, t in zip(messages, numbered, strict=True) if t <= turn]
            for turn in sorted(set(numbered))
        ]
    else:
        turns = turns_at_assistant(messages)
    return Trace(path.stem, turns, tools, str(path))
