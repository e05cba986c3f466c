"""SWE-agent ``.traj`` files: the ``history`` field.

``history`` is the agent's message list in order. The request for each assistant message is every
message before it, so each assistant message gives one turn. In text-based trajectories (older
SWE-agent, no ``tool_calls``) the environment answers with plain ``user`` messages: every user
message that follows an assistant message is an observation and is flagged as one. The user
messages before the first action (demonstrations, the issue) are not. Tool schemas are not
recorded in ``.traj`` files, so ``tools`` is ``None``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from leyline_agent.messages import OBSERVATION_KEY
from leyline_agent.traces import Trace, TraceFormatError, normalize_messages, turns_at_assistant


def matches(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get("history"), list)


def load_data(data: dict[str, Any], path: Path) -> list[Trace]:
    if not matches(data):
        raise TraceFormatError(f"{path}: no 'history' list")
    messages = []
    acted = False
    for msg in normalize_messages(data["history"]):
        if msg["role"] == "user" and acted:
            msg[OBSERVATION_KEY] = True
        acted = acted or msg["role"] == "assistant"
        messages.append(msg)
    return [Trace(path.stem, turns_at_assistant(messages), None, str(path))]


def load(path: str | Path) -> list[Trace]:
    from leyline_agent.traces import read_json

    return load_data(read_json(Path(path)), Path(path))
