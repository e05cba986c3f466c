"""Constrained tool calls for a model with random weights (the embedded default).

Random weights never emit a parsable tool call on their own. SGLang's constrained decoding can
force one: with ``tool_choice="auto"`` and an ``ebnf`` grammar in the request body (xgrammar's
EBNF), the output is exactly one call in the chat template's format, which SGLang's ``qwen25``
tool-call parser turns into ``message.tool_calls``. Only read-only tools are allowed (``view``,
``listdir``, ``eval``: never ``bash`` or ``edit`` with random weights) and every argument is
bounded (``view``'s path is one of the task's files), so decoding ends within ``max_tokens``.
``step_grammars`` also keeps the model from repeating its recent tools.

What did not work (``SGLANG_NOTES.md``): ``tool_choice="required"`` (its JSON arguments fill
with whitespace until ``max_tokens``) and a named ``tool_choice`` (not enforced).

The grammar travels in debug-gym's own request (``generate_kwargs.extra_body.ebnf``); the proxy
forwards unknown body fields unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

READ_ONLY_TOOLS: tuple[str, ...] = ("view", "listdir", "eval")
_IGNORED_PARTS = {"__pycache__", ".pytest_cache"}
_IGNORED_SUFFIXES = {".pyc", ".pyo"}
CALL_OPEN = '<tool_call>\n{"name": '
CALL_CLOSE = "}\n</tool_call>"
VIEW_HEAD = '"view", "arguments": {"path": '


def task_files(task_dir: Path) -> list[str]:
    """Paths (relative, ``/``-separated) the agent may view: no hidden or cache files."""
    out = []
    for p in sorted(task_dir.rglob("*")):
        rel = p.relative_to(task_dir)
        if not p.is_file() or p.suffix in _IGNORED_SUFFIXES:
            continue
        if any(part.startswith(".") or part in _IGNORED_PARTS for part in rel.parts):
            continue
        out.append(rel.as_posix())
    return out


def _lit(text: str) -> str:
    """An EBNF string literal for ``text``."""
    return json.dumps(text)


def tool_call_grammar(tools: Sequence[str], files: Iterable[str]) -> str:
    """EBNF for one ``<tool_call>`` of one of ``tools`` (a subset of ``READ_ONLY_TOOLS``).

    The call is rendered as the embedded chat template renders a tool call, compact::

        <tool_call>
        {"name": "view", "arguments": {"path": "counter_code.py"}}
        </tool_call>

    Raises:
        ValueError: a tool outside ``READ_ONLY_TOOLS``, no tools, or ``view`` without files.
    """
    tools = list(dict.fromkeys(tools))
    bad = [t for t in tools if t not in READ_ONLY_TOOLS]
    if bad or not tools:
        raise ValueError(
            f"constrained tool calls allow only {', '.join(READ_ONLY_TOOLS)}; got {tools}"
        )
    files = list(dict.fromkeys(files))
    if "view" in tools and not files:
        raise ValueError("the view tool needs at least one file to choose from")
    calls = {
        "view": f"{_lit(VIEW_HEAD)} path {_lit('}')}",
        "listdir": _lit('"listdir", "arguments": {}'),
        "eval": _lit('"eval", "arguments": {}'),
    }
    rules = [f"root ::= {_lit(CALL_OPEN)} call {_lit(CALL_CLOSE)}"]
    rules.append("call ::= " + " | ".join(f"call_{t}" for t in tools))
    rules += [f"call_{t} ::= {calls[t]}" for t in tools]
    if "view" in tools:
        rules.append("path ::= " + " | ".join(_lit(json.dumps(f)) for f in files))
    return "\n".join(rules) + "\n"


def step_grammars(tools: Sequence[str], files: Sequence[str]) -> dict[str, str]:
    """A grammar for every non-empty subset of ``tools`` (kept in order), keyed by
    ``",".join(subset)``. The driver picks, before each call, the subset of tools not used in the
    last ``len(tools) - 1`` steps (froggy's own rule, "do not repeat your previous action",
    stretched): a greedy random model then cycles through every tool instead of calling one or
    two forever, so file views, listings and test runs (which also rewrite froggy's system
    prompt) all occur. The model still picks the first tool and every file to view."""
    tools = list(dict.fromkeys(tools))
    out = {}
    for mask in range(1, 2 ** len(tools)):
        subset = [t for i, t in enumerate(tools) if mask >> i & 1]
        out[",".join(subset)] = tool_call_grammar(subset, files)
    return out
