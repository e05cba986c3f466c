"""The proxy's own cost per turn: ``ConversationWrapper.plan`` with full vs incremental rendering.

Per appended turn, the time to plan it (policy, render of the incoming and the edited list,
diff, verification) against the history length, with ``stale_tool_outputs:keep_last=2``
(``--policy``), on

- the longest shared trace (``<shared>/traces``: most tokens in its last turn), every turn;
- a synthetic tool-calling conversation grown until it holds ``--target`` tokens, sampled at a
  few lengths and at its last five turns.

    .venv/bin/python experiments/agent/bench_planning.py [--target 32000] [--repeats 5]

Columns: the incoming conversation's tokens (``conv tok``), the previous prompt the server holds
(``history``, after the policy's stubs) and this turn's prompt. Times are the best of
``--repeats`` plans of the same turn from the same state (the machine is shared: slower runs
measure the neighbours), in wall-clock milliseconds (what a request waits; the process's CPU time
would also count the tokenizer's worker threads, which spin while it encodes). Every sampled plan of both modes is
checked to give the same tokens, spans and directives. The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from leyline_agent.chat.model_dir import load_renderer
from leyline_agent.chat.render import Renderer
from leyline_agent.traces import Trace, load
from leyline_agent.wrapper import ConversationWrapper, TurnPlan

ROOT = Path(__file__).resolve().parents[2]
POLICY = "stale_tool_outputs:keep_last=2"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    }
]


def shared_traces() -> Path | None:
    sys.path.insert(0, str(ROOT / "tests"))
    from shared_data import shared_dir

    return shared_dir("traces")


def longest_trace(renderer: Renderer, path: Path) -> Trace:
    traces = [t for t in load(path) if t.turns]
    return max(traces, key=lambda t: len(renderer.render(t.turns[-1], t.tools).tokens))


def synthetic_turns(renderer: Renderer, target: int, seed: int = 0) -> list[list[dict]]:
    """Message lists of a growing agent run: one assistant tool call + its output per turn."""
    rng = random.Random(seed)
    words = "def return self value index path error test assert import file line".split()
    msgs: list[dict] = [
        {"role": "system", "content": "You are a careful software engineering agent."},
        {"role": "user", "content": "The test suite fails in tests/test_io.py; fix it."},
    ]
    turns, i = [], 0
    while True:
        call = {"id": f"call_{i}", "type": "function", "function": {"name": "bash"}}
        call["function"]["arguments"] = json.dumps({"cmd": f"sed -n {i},{i + 40}p src/m{i}.py"})
        lines = [
            f"{j:4d}  " + " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
            for j in range(rng.randint(5, 60))
        ]
        msgs = msgs + [
            {"role": "assistant", "content": f"Step {i}: look at m{i}.py.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": "\n".join(lines)},
        ]
        turns.append(msgs)
        i += 1
        if i % 10 == 0 and len(renderer.render_text(msgs, TOOLS)) > 4.2 * target:
            if len(renderer.encode(renderer.render_text(msgs, TOOLS))) > target:
                return turns


def best_of(fn: Callable[[], TurnPlan], before: Callable[[], None], repeats: int) -> tuple:
    times, plan = [], None
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        plan = fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1000, plan


def same(a: TurnPlan, b: TurnPlan) -> bool:
    return (a.tokens, a.spans, a.directives, a.tail, a.fallback) == (
        b.tokens,
        b.spans,
        b.directives,
        b.tail,
        b.fallback,
    )


def time_turns(
    policy: str,
    renderer: Renderer,
    turns: list[list[dict]],
    tools: list | None,
    sample: set[int],
    repeats: int,
) -> list[dict]:
    """Per sampled turn: history tokens, full and incremental plan time (ms)."""
    inc = ConversationWrapper(renderer, policy)
    full = ConversationWrapper(renderer, policy, incremental=False)
    rows = []
    for t, messages in enumerate(turns):
        if t not in sample:
            full_plan = None
            plan = inc.plan(messages, tools)
        else:
            states = inc.incremental._states  # NOTE: restored so that every repeat does the work

            def restore(states: list = states) -> None:
                inc.incremental._states = list(states)

            inc_ms, plan = best_of(partial(inc.plan, messages, tools), restore, repeats)
            full_ms, full_plan = best_of(
                partial(full.plan, messages, tools), lambda: None, max(1, repeats // 3)
            )
            if not same(plan, full_plan):
                raise SystemExit(f"turn {t}: incremental plan differs from the full one")
            rows.append(
                {
                    "turn": t,
                    "messages": len(messages),
                    "conversation_tokens": len(
                        renderer.encode(renderer.render_text(messages, tools))
                    ),
                    "history_tokens": len(inc.tokens),
                    "tokens": len(plan.tokens),
                    "full_ms": round(full_ms, 2),
                    "incremental_ms": round(inc_ms, 2),
                    "speedup": round(full_ms / max(inc_ms, 1e-3), 1),
                }
            )
        inc.commit(plan)
        full.commit(full_plan or plan)  # unsampled turns: the same plan, without the full cost
    return rows


def table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(
        f"{'turn':>5} {'messages':>8} {'conv tok':>8} {'history':>8} {'prompt':>7} "
        f"{'full ms':>9} {'incr ms':>8} {'speedup':>8}"
    )
    for r in rows:
        print(
            f"{r['turn']:>5} {r['messages']:>8} {r['conversation_tokens']:>8} "
            f"{r['history_tokens']:>8} {r['tokens']:>7} {r['full_ms']:>9.1f} "
            f"{r['incremental_ms']:>8.2f} {r['speedup']:>7.1f}x"
        )


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True)
        return out.stdout.decode().strip()
    except OSError:
        return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=int, default=32000, help="synthetic history tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--policy", default=POLICY, help="policy spec")
    ap.add_argument("--trace", type=Path, default=None, help="a trace file (default: longest)")
    args = ap.parse_args()

    renderer = load_renderer()
    _ = renderer.incremental_checks  # one-time checks, not per turn
    out: dict = {
        "policy": args.policy,
        "machine": platform.machine(),
        "python": sys.version.split()[0],
    }
    out["commit"] = commit()

    path = args.trace or shared_traces()
    if path is not None:
        trace = longest_trace(renderer, path) if path.is_dir() else load(path)[0]
        rows = time_turns(
            args.policy, renderer, trace.turns, trace.tools, set(range(len(trace.turns))), 3
        )
        table(f"trace {trace.name} ({trace.source}), every turn", rows)
        out["trace"] = {"name": trace.name, "turns": rows}

    turns = synthetic_turns(renderer, args.target)
    n = len(turns)
    sample = {n * k // 8 - 1 for k in (1, 2, 4)} | set(range(n - 5, n))
    rows = time_turns(args.policy, renderer, turns, TOOLS, sample, args.repeats)
    table(f"synthetic, grown to {args.target} tokens of history", rows)
    last = rows[-5:]
    out["synthetic"] = {
        "turns": rows,
        "at_target": {
            "conversation_tokens": last[-1]["conversation_tokens"],
            "history_tokens": last[-1]["history_tokens"],
            "full_ms_median": statistics.median(r["full_ms"] for r in last),
            "incremental_ms_median": statistics.median(r["incremental_ms"] for r in last),
        },
    }
    at = out["synthetic"]["at_target"]
    print(
        f"\nconversation of {at['conversation_tokens']} tokens "
        f"({at['history_tokens']} in the edited prompt): full {at['full_ms_median']:.1f} ms, "
        f"incremental {at['incremental_ms_median']:.2f} ms per appended turn (median of 5)"
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
