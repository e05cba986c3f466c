"""Reasoning-model chat templates as published (``tests/templates``) on a tokenizer built here,
and agent sessions whose assistant turns carry reasoning: what the template-edit tests share.

The tokenizer is the embedded one (o200k, ChatML specials) plus each family's role and tool
markers as special tokens, so that the token structure is the family's; no hub at run time.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any, Literal

from tokenizers import AddedToken, Tokenizer

from leyline_agent.chat.model_dir import load_renderer
from leyline_agent.chat.render import Renderer

TEMPLATES = Path(__file__).parent / "templates"
SPECIALS: dict[str, list[str]] = {
    "qwen3": [],  # ChatML: <|im_start|>/<|im_end|> are the embedded tokenizer's own
    "glm45": ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
    "kimi_k2_thinking": [
        "<|im_user|>",
        "<|im_assistant|>",
        "<|im_system|>",
        "<|im_middle|>",
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    ],
}
FAMILIES = sorted(SPECIALS)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Print a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]

Reasoning = Literal["field", "inline", "dropped"]


@cache
def tokenizer(family: str) -> Tokenizer:
    tok = Tokenizer.from_str(load_renderer().tokenizer.to_str())
    tok.add_special_tokens(
        [AddedToken(s, special=True, normalized=False) for s in SPECIALS[family]]
    )
    return tok


def template(family: str) -> str:
    return (TEMPLATES / f"{family}.jinja").read_text()


def renderer(family: str) -> Renderer:
    return Renderer(tokenizer(family), template(family), source=family)


def assistant(
    step: str, content: str, reasoning: Reasoning, calls: Sequence[dict[str, Any]] = ()
) -> dict[str, Any]:
    """An assistant message whose reasoning is sent back as ``reasoning_content``, inline in
    ``content`` (``<think>…</think>answer``), or not at all."""
    thought = f"I should look at {step} first; it is where the failing value comes from."
    m: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning == "field":
        m["reasoning_content"] = thought
    elif reasoning == "inline":
        m["content"] = f"<think>\n{thought}\n</think>\n\n{content}"
    if calls:
        m["tool_calls"] = list(calls)
    return m


def session(
    episodes: Sequence[Sequence[int]], reasoning: Sequence[Reasoning] = ("field",)
) -> list[list[dict[str, Any]]]:
    """Per turn, the full message list an agent sends. Each episode is a user query (the first
    one after a system prompt, later ones follow-ups), tool steps (``episode[i]`` parallel calls
    each) and an answer; a turn ends after every step's outputs and after every query. The
    assistant messages' reasoning cycles through ``reasoning``."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful engineer."}]
    turns: list[list[dict[str, Any]]] = []
    n = 0

    def mode() -> Reasoning:
        nonlocal n
        n += 1
        return reasoning[(n - 1) % len(reasoning)]

    for e, steps in enumerate(episodes):
        query = "The tests fail. Find the bug." if e == 0 else f"Thanks. Now follow-up {e}?"
        msgs.append({"role": "user", "content": query})
        turns.append(list(msgs))
        for s, k in enumerate(steps):
            calls = [
                {
                    "id": f"call_{e}_{s}_{j}",
                    "type": "function",
                    "function": {
                        "name": "read_file",
                        "arguments": json.dumps({"path": f"src/m{e}{s}{j}.py"}),
                    },
                }
                for j in range(k)
            ]
            content = "" if s % 2 else f"Reading {len(calls)} file(s)."
            msgs.append(assistant(f"module {e}.{s}", content, mode(), calls))
            for j, c in enumerate(calls):
                body = "\n".join(f"{i:3d} def f{e}{s}{j}_{i}(x): return x * {i}" for i in range(8))
                msgs.append({"role": "tool", "tool_call_id": c["id"], "content": body})
            turns.append(list(msgs))
        msgs.append(assistant(f"episode {e}", f"The bug of episode {e} is in line 3.", mode()))
    return turns


def exact_reuse(old: Sequence[int], new: Sequence[int]) -> int:
    """Old tokens an exact splice keeps: the longest in-order matching of the old prompt's tokens
    with the new ones (difflib's matching blocks on the token ids)."""
    sm = difflib.SequenceMatcher(None, list(old), list(new), autojunk=False)
    return sum(b.size for b in sm.get_matching_blocks())
