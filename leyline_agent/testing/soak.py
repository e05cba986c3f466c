"""Concurrent agent sessions through the proxy (issue 11's soak), with the real ``openai`` client.

Each session is a synthetic tool-using agent: per turn it sends its whole history (system, task,
then assistant tool calls and tool outputs), teacher-forced, ``max_tokens`` small; the proxy's
policy edits the stale tool outputs and splices. Used by ``tests/test_proxy_resilience.py`` (short)
and ``experiments/backend/soak_proxy.py`` (16 sessions x 50 turns).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

import httpx
import openai

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolUnionParam

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Print a file with line numbers.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "maxLength": 64}},
                "required": ["path"],
            },
        },
    }
]


def tool_output(session: int, step: int, lines: int) -> str:
    return "\n".join(
        f"{i:3d}  x_{session}_{step}_{i} = compute({i}, {step}) + {session}"
        for i in range(1, lines + 1)
    )


def turn_messages(session: int, turns: int, lines: int) -> list[list[dict[str, Any]]]:
    """The full message list of each turn of one session."""
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful engineer. Use the tools."},
        {"role": "user", "content": f"Task {session}: find why the tests fail."},
    ]
    out = [list(history)]
    for step in range(1, turns):
        call = {
            "id": f"call_{session}_{step}",
            "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": f"m{step}.py"})},
        }
        history.append({"role": "assistant", "content": f"Step {step}.", "tool_calls": [call]})
        history.append(
            {
                "role": "tool",
                "tool_call_id": call["id"],
                "content": tool_output(session, step, lines),
            }
        )
        out.append(list(history))
    return out


def run_soak(
    proxy_url: str, *, sessions: int, turns: int, lines: int = 8, max_tokens: int = 2
) -> dict[str, Any]:
    """Run ``sessions`` concurrent sessions of ``turns`` turns. Returns the figures: turns,
    errors by status, p50/p90 turn seconds, and the proxy's counters (``/leyline/sessions``)."""
    errors: dict[str, int] = {}
    times: list[float] = []
    lock = threading.Lock()

    def one(s: int) -> None:
        client = openai.OpenAI(
            base_url=proxy_url + "/v1",
            api_key="unused",
            max_retries=0,
            timeout=600,
            default_headers={"X-Leyline-Session": f"soak-{s}"},
        )
        for messages in turn_messages(s, turns, lines):
            t = time.perf_counter()
            try:
                # Plain JSON dicts, shaped as the SDK's TypedDicts.
                client.chat.completions.create(
                    model="default",
                    messages=cast("list[ChatCompletionMessageParam]", messages),
                    tools=cast("list[ChatCompletionToolUnionParam]", TOOLS),
                    max_tokens=max_tokens,
                    temperature=0,
                )
                key = None
            except openai.APIStatusError as e:
                key = str(e.status_code)
            except openai.APIConnectionError:
                key = "connection"
            with lock:
                times.append(time.perf_counter() - t)
                if key:
                    errors[key] = errors.get(key, 0) + 1

    with ThreadPoolExecutor(max_workers=sessions) as pool:
        list(pool.map(one, range(sessions)))
    totals = httpx.get(proxy_url + "/leyline/sessions", timeout=30).json()["totals"]
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [0.0] * 9
    return {
        "sessions": sessions,
        "turns": len(times),
        "errors": errors,
        "errors_5xx": sum(v for k, v in errors.items() if k.startswith("5")),
        "p50_s": round(statistics.median(times), 3),
        "p90_s": round(q[8], 3),
        "edited_turns": totals["edited_turns"],
        "spliced_turns": totals["spliced_turns"],
        "splice_misses": totals["splice_misses"],
        "misses_by_reason": totals.get("misses_by_reason", {}),
        "prefilled_tokens": totals["prefilled_tokens"],
        "prompt_tokens": totals["prompt_tokens"],
    }
