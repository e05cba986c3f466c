"""debug-gym run logs (``<problem>.json`` written by its agents).

Shape: ``{"problem", "tools": [...], "log": [{"step_id", "prompt_response_pairs": [{"prompt":
[messages], "response", "tool", ...}], ...}]}``. Every prompt/response pair is one model call, and
its ``prompt`` is the full message list sent, so each pair is one turn (step 0, the initial
observation, has none). The top-level ``tools`` were sent with every call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from leyline_agent.traces import Trace, TraceFormatError, normalize_messages, normalize_tools


def matches(data: Any) -> bool:
    return (
        isinstance(data, dict)
        and isinstance(data.get("log"), list)
        and any(isinstance(s, dict) and "prompt_response_pairs" in s for s in data["log"])
    )


def load_data(data: dict[str, Any], path: Path) -> list[Trace]:
    if not matches(data):
        raise TraceFormatError(f"{path}: no 'log' with 'prompt_response_pairs'")
    turns = []
    for step in data["log"]:
        for pair in step.get("prompt_response_pairs") or []:
            prompt = pair.get("prompt")
            if not isinstance(prompt, list):
                raise TraceFormatError(f"{path}: step {step.get('step_id')} has no prompt list")
            turns.append(normalize_messages(prompt))
    tools = normalize_tools(data.get("tools"))
    return [Trace(path.stem, turns, tools, str(path))]


def load(path: str | Path) -> list[Trace]:
    from leyline_agent.traces import read_json

    return load_data(read_json(Path(path)), Path(path))
