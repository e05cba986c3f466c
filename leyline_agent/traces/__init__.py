"""Trace loaders: public agent trajectories as the per-turn message lists the agent sent.

``load(path)`` reads a file or a directory (recursively) and returns every trace in it. Formats:

- SWE-agent ``.traj`` (``swe_agent.py``): the ``history`` field.
- debug-gym run logs (``debug_gym.py``): the per-step ``prompt_response_pairs`` records.
- OpenAI-message JSONL (``jsonl.py``): see that module for the two accepted shapes.

Messages are normalised to OpenAI chat messages (``role``, ``content``, ``tool_calls``,
``tool_call_id``, ``name``); text-based agents' tool outputs (plain ``user`` messages answering an
action) carry ``"leyline_observation": True`` so that policies treat them like ``role: "tool"``.
Anthropic-format messages (what debug-gym logs for Claude models) become their OpenAI equivalents
(``normalize.py``): an assistant's ``tool_use`` blocks become ``tool_calls`` and each
``tool_result`` block of a user message becomes a ``role: "tool"`` message.

Nothing is skipped silently: ``load(DIR)`` returns the traces together with every file it did not
load and why (``Traces.skipped``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from leyline_agent.traces.normalize import (
    Message,
    TraceFormatError,
    normalize_message,
    normalize_messages,
    normalize_tools,
)


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
        old = debug_gym.one_document(path)
        return debug_gym.load_data(old, path) if old is not None else jsonl.load(path)
    data = read_json(path)
    for loader in (swe_agent, debug_gym):
        if loader.matches(data):
            return loader.load_data(data, path)
    raise TraceFormatError(
        f"{path}: not a SWE-agent .traj (no 'history'), debug-gym log (no 'log' with "
        "'prompt_response_pairs') or JSONL of OpenAI messages"
    )


SUFFIXES = (".traj", ".json", ".jsonl")


class Skipped(NamedTuple):
    """A file under a directory that ``load`` did not load, and why."""

    path: str
    reason: str


class Traces(list[Trace]):
    """``load``'s result: the traces (a list), and ``skipped``: every file under the loaded
    directory that gave no trace, with the reason (empty for a single file, which raises)."""

    def __init__(self, traces: Sequence[Trace] = (), skipped: Sequence[Skipped] = ()) -> None:
        super().__init__(traces)
        self.skipped: list[Skipped] = list(skipped)


def load(path: str | Path) -> Traces:
    """Every trace in a file, or in a directory (recursively).

    A directory's files that give no trace are listed in ``Traces.skipped`` with the reason: a
    suffix other than ``SUFFIXES``, a format error (the loader's message), or no model call
    recorded. A single file that gives no trace raises instead.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        TraceFormatError: ``path`` is a file in no known format, or one without model calls.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if path.is_file():
        traces = load_file(path)
        if not any(t.turns for t in traces):
            raise TraceFormatError(f"{path}: no model call recorded")
        return Traces([t for t in traces if t.turns])
    result = Traces()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        if file.suffix not in SUFFIXES:
            result.skipped.append(Skipped(str(file), f"not a {'/'.join(SUFFIXES)} file"))
            continue
        try:
            traces = load_file(file)
        except (TraceFormatError, UnicodeDecodeError) as e:
            result.skipped.append(Skipped(str(file), str(e).removeprefix(f"{file}: ")))
            continue
        if not any(t.turns for t in traces):
            result.skipped.append(Skipped(str(file), "no model call recorded"))
        result += [t for t in traces if t.turns]
    return result


__all__ = [
    "SUFFIXES",
    "Skipped",
    "Trace",
    "TraceFormatError",
    "Traces",
    "load",
    "load_file",
    "normalize_message",
    "normalize_messages",
    "normalize_tools",
]
