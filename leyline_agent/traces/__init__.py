"""Trace loaders: public agent trajectories as the per-turn message lists the agent sent.

``load(path)`` reads a file or a directory (recursively) and returns every trace in it. Formats:

- SWE-agent ``.traj`` (``swe_agent.py``): the ``history`` field.
- debug-gym run logs (``debug_gym.py``): the per-step ``prompt_response_pairs`` records.
- OpenAI-message JSONL (``jsonl.py``): see that module for the two accepted shapes.

Messages are normalised to OpenAI chat messages (``role``, ``content``, ``tool_calls``,
``tool_call_id``, ``name``); text-based agents' tool outputs (plain ``user`` messages answering an
action) carry ``"leyline_observation": True`` so that policies treat them like ``role: "tool"``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leyline_agent.policies.base import OBSERVATION_KEY, message_text

Message = dict[str, Any]


@dataclass(frozen=True)
class Trace:
    """One agent run.

    Attributes:
        name: a short name (file stem, plus a suffix when a file holds several runs).
        turns: per model call, the full message list sent at that step, in order.
        tools: the tool schemas sent with every call (OpenAI format), if recorded.
        source: the file it came from.
    """

    name: str
    turns: list[list[Message]]
    tools: list[dict[str, Any]] | None
    source: str


class TraceFormatError(ValueError):
    """A file is not in the format its loader expects."""


def normalize_message(raw: Mapping[str, Any]) -> Message:
    """An OpenAI chat message from a recorded one (framework-specific keys dropped).

    Keeps ``role``, ``content`` (text parts joined with spaces), ``tool_calls`` (arguments as JSON strings),
    ``tool_call_id`` (SWE-agent's ``tool_call_ids[0]``), ``name`` on tool messages, and
    ``leyline_observation``.
    """
    role = raw.get("role")
    if not isinstance(role, str):
        raise TraceFormatError(f"message without a role: {str(raw)[:120]}")
    content = raw.get("content")
    if isinstance(content, list):
        content = message_text(raw)
    msg: Message = {"role": role, "content": content}
    if raw.get("tool_calls"):
        msg["tool_calls"] = [_tool_call(c) for c in raw["tool_calls"]]
    if role == "tool":
        call_id = raw.get("tool_call_id") or (raw.get("tool_call_ids") or [None])[0]
        if call_id is not None:
            msg["tool_call_id"] = call_id
        if raw.get("name"):
            msg["name"] = raw["name"]
    if raw.get(OBSERVATION_KEY):
        msg[OBSERVATION_KEY] = True
    return msg


def _tool_call(raw: Mapping[str, Any]) -> dict[str, Any]:
    fn = raw.get("function", raw)
    args = fn.get("arguments", {})
    call = {
        "type": "function",
        "function": {
            "name": fn.get("name"),
            "arguments": args if isinstance(args, str) else json.dumps(args),
        },
    }
    if raw.get("id") is not None:
        call["id"] = raw["id"]
    return call


def turns_at_assistant(messages: Sequence[Message]) -> list[list[Message]]:
    """Per assistant message, the messages before it: what the agent sent for that reply."""
    return [list(messages[:i]) for i, m in enumerate(messages) if m["role"] == "assistant" and i]


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{path}: not JSON ({e})") from e


def load_file(path: str | Path) -> list[Trace]:
    """Traces in one file; the format is chosen by content (and suffix for JSONL).

    Raises:
        TraceFormatError: not a recognised trace format.
    """
    from leyline_agent.traces import debug_gym, jsonl, swe_agent

    path = Path(path)
    if path.suffix == ".jsonl":
        return jsonl.load(path)
    data = read_json(path)
    for loader in (swe_agent, debug_gym):
        if loader.matches(data):
            return loader.load_data(data, path)
    raise TraceFormatError(
        f"{path}: not a SWE-agent .traj (no 'history'), debug-gym log (no 'log' with "
        "'prompt_response_pairs') or JSONL of OpenAI messages"
    )


SUFFIXES = (".traj", ".json", ".jsonl")


def load(path: str | Path) -> list[Trace]:
    """Every trace in a file, or in a directory (recursively; files that are no trace skipped).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        TraceFormatError: ``path`` is a file in no known format.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if path.is_file():
        return load_file(path)
    traces: list[Trace] = []
    for file in sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES):
        try:
            traces += load_file(file)
        except TraceFormatError:
            continue
    return traces


__all__ = ["SUFFIXES", "Trace", "TraceFormatError", "load", "load_file", "normalize_message"]
