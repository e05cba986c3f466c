"""debug-gym run logs (``<problem>.json`` written by its agents).

Shape: ``{"problem", "tools": [...], "log": [{"step_id", "prompt_response_pairs": [{"prompt":
[messages], "response", "tool", ...}], ...}]}``. Every prompt/response pair is one model call, and
its ``prompt`` is the full message list sent, so each pair is one turn (step 0, the initial
observation, has none). The top-level ``tools`` were sent with every call.

Before debug-gym PR #230 its agents wrote that same document into a ``.jsonl`` file
(``debug_gym.jsonl``, ``froggy.jsonl``; one JSON document, pretty-printed or on one line):
``one_document`` recognises it, and such a trace is named after its ``problem``.
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
    problem = data.get("problem")
    name = problem if path.suffix == ".jsonl" and isinstance(problem, str) else path.stem
    return [Trace(name, turns, tools, str(path))]


def one_document(path: Path) -> dict[str, Any] | None:
    """The debug-gym log in a ``.jsonl`` file that holds one JSON document (debug-gym before
    PR #230), else None (a real JSONL: several documents, or one that is no debug-gym log)."""
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if matches(data) else None


def load(path: str | Path) -> list[Trace]:
    from leyline_agent.traces import read_json

    return load_data(read_json(Path(path)), Path(path))
