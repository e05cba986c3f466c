"""The proxy's own cost per turn: ``ConversationWrapper.plan`` with full vs incremental rendering.

Per turn, the time to plan it (policy, render, diff, verification) against the history length,
with ``none`` and ``stale_tool_outputs:keep_last=2`` (``--policy``; several: separated by ``;``),
on

- the longest shared trace (``<shared>/traces``: most tokens in its last turn), every turn;
- per ``--sizes`` (default 8000, 32000, 52000 tokens), two synthetic tool-calling conversations
  grown until they hold that many tokens, sampled at their last five turns (plus a few earlier):
  ``append``, where turns only append (one assistant tool call + its output), and ``head``,
  debug-gym's froggy shape, where the first message (the task plus a test report, about 2.9
  characters per target token: 150k characters at 52k) also changes by a few characters near
  its end every turn (the report's ``Date:`` line).

    .venv/bin/python experiments/agent/bench_planning.py [--sizes 8000,32000,52000] [--repeats 5]
        [--no-trace] [--policy "none;stale_tool_outputs:keep_last=2"]

Columns: the incoming conversation's tokens (``conv tok``), the previous prompt the server holds
(``history``, after the policy's stubs) and this turn's prompt. Times are the best of
``--repeats`` plans of the same turn from the same state (the machine is shared: slower runs
measure the neighbours), in milliseconds: wall clock (what a request waits) and the planning
thread's CPU time (``time.thread_time``: steadier on a loaded machine, where the wall clock also
counts waiting for a core; the process's CPU time would also count the tokenizer's worker
threads, which spin while it encodes). The summary gives medians over the last five turns.
Every sampled plan of both modes is checked to give the same tokens, spans and directives. The
summary says, per shape and policy at ``--target-size`` tokens (52000), whether the median thread
CPU time meets the target (issue 23: ``--target-ms`` 5 ms per turn), and gives the load average
before and after (``os.getloadavg``: a loaded machine slows the thread too). The last stdout line
is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from leyline_agent.chat.head import head_local
from leyline_agent.chat.model_dir import load_renderer
from leyline_agent.chat.render import Renderer
from leyline_agent.chat.retokenize import line_cuts
from leyline_agent.traces import Trace, load
from leyline_agent.wrapper import ConversationWrapper, TurnPlan

ROOT = Path(__file__).resolve().parents[2]
POLICY = "none;stale_tool_outputs:keep_last=2"
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


def head_turns(renderer: Renderer, target: int, seed: int = 0) -> list[list[dict]]:
    """Message lists of a froggy-style run: the first message (task + a test report of about
    ``2.9 * target`` characters, whose ``Date:`` line near the end changes every turn) is sent
    anew each turn, and one assistant tool call + its output is appended."""
    rng = random.Random(seed)
    words = "def return self value index path error test assert import file line".split()
    report, n = [], 0
    while n < 2.9 * target:
        outcome = rng.choice(["PASSED", "PASSED", "FAILED", "ERROR"])
        line = f"tests/test_m{len(report) % 97}.py::test_case_{len(report)} {outcome} " + " ".join(
            rng.choice(words) for _ in range(rng.randint(2, 10))
        )
        report.append(line)
        n += len(line) + 1

    def first(t: int) -> dict:
        lines = list(report)
        lines.insert(
            len(lines) - 20,
            f"Date: Tue Dec  1 {t // 3600 % 24:02d}:{t // 60 % 60:02d}:{t % 60:02d} 2026",
        )
        text = "You are froggy, a debugging agent. Task: fix the failing tests.\n\n"
        return {"role": "system", "content": text + "\n".join(lines)}

    msgs: list[dict] = [first(0), {"role": "user", "content": "The test suite fails; fix it."}]
    turns, i = [], 0
    while True:
        call = {"id": f"call_{i}", "type": "function", "function": {"name": "bash"}}
        call["function"]["arguments"] = json.dumps({"cmd": f"sed -n {i},{i + 40}p src/m{i}.py"})
        lines = [
            f"{j:4d}  " + " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
            for j in range(rng.randint(5, 30))
        ]
        msgs = [
            first(i + 1),
            *msgs[1:],
            {"role": "assistant", "content": f"Step {i}: look at m{i}.py.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": "\n".join(lines)},
        ]
        turns.append(msgs)
        i += 1
        if i % 5 == 0 and len(renderer.encode(renderer.render_text(msgs, TOOLS))) > target:
            return turns


def best_of(fn: Callable[[], TurnPlan], before: Callable[[], None], repeats: int) -> tuple:
    """The best wall-clock and thread-CPU milliseconds of ``repeats`` calls, and the last plan."""
    times, cpu, plan = [], [], None
    for _ in range(repeats):
        before()
        t0, c0 = time.perf_counter(), time.thread_time()
        plan = fn()
        cpu.append(time.thread_time() - c0)
        times.append(time.perf_counter() - t0)
    return min(times) * 1000, min(cpu) * 1000, plan


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
    with_full: bool = True,
) -> list[dict]:
    """Per sampled turn: history tokens, full and incremental plan time (ms; full: NaN without
    ``with_full``)."""
    inc = ConversationWrapper(renderer, policy)
    full = ConversationWrapper(renderer, policy, incremental=False)
    rows = []
    for t, messages in enumerate(turns):
        if t not in sample:
            full_plan = None
            plan = inc.plan(messages, tools)
        else:
            # NOTE: the remembered renders and encoded pieces are restored so that every repeat
            # does the work (a repeat would otherwise find this turn's pieces already encoded).
            saved = (inc.incremental._states, dict(inc.incremental._pieces))
            chars = inc.incremental._piece_chars

            def restore(saved: tuple = saved, chars: int = chars) -> None:
                inc.incremental._states = list(saved[0])
                inc.incremental._pieces = dict(saved[1])
                inc.incremental._piece_chars = chars

            inc_ms, inc_cpu, plan = best_of(partial(inc.plan, messages, tools), restore, repeats)
            full_ms, full_plan = float("nan"), None
            if with_full:
                full_ms, _, full_plan = best_of(
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
                    "incremental_cpu_ms": round(inc_cpu, 2),
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
        f"{'full ms':>9} {'incr ms':>8} {'incr cpu':>8} {'speedup':>8}"
    )
    for r in rows:
        print(
            f"{r['turn']:>5} {r['messages']:>8} {r['conversation_tokens']:>8} "
            f"{r['history_tokens']:>8} {r['tokens']:>7} {r['full_ms']:>9.1f} "
            f"{r['incremental_ms']:>8.2f} {r['incremental_cpu_ms']:>8.2f} {r['speedup']:>7.1f}x"
        )


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True)
        return out.stdout.decode().strip()
    except OSError:
        return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8000,32000,52000", help="synthetic history tokens")
    ap.add_argument("--shapes", default="append,head", help="synthetic shapes")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--policy", default=POLICY, help="policy spec(s), ';'-separated")
    ap.add_argument("--trace", type=Path, default=None, help="a trace file (default: longest)")
    ap.add_argument("--no-trace", action="store_true", help="skip the shared trace")
    ap.add_argument(
        "--no-full", action="store_true", help="no full-render baseline (nor its equality check)"
    )
    ap.add_argument("--target-ms", type=float, default=5.0, help="median thread CPU per turn")
    ap.add_argument("--target-size", type=int, default=52000, help="size the target is for")
    args = ap.parse_args()
    load0 = os.getloadavg()

    renderer = load_renderer()
    _ = renderer.incremental_checks  # one-time checks, not per turn
    _ = head_local(renderer), line_cuts(renderer.tokenizer)
    policies = [p for p in args.policy.split(";" if ";" in args.policy else ",") if p]
    out: dict = {
        "policies": policies,
        "machine": platform.machine(),
        "python": sys.version.split()[0],
    }
    out["commit"] = commit()

    path = None if args.no_trace else args.trace or shared_traces()
    if path is not None:
        trace = longest_trace(renderer, path) if path.is_dir() else load(path)[0]
        rows = time_turns(
            policies[0], renderer, trace.turns, trace.tools, set(range(len(trace.turns))), 3
        )
        table(f"trace {trace.name} ({trace.source}), every turn", rows)
        out["trace"] = {"name": trace.name, "turns": rows}

    makers = {"append": synthetic_turns, "head": head_turns}
    summary = []
    for size in [int(x) for x in args.sizes.split(",")]:
        for shape in args.shapes.split(","):
            turns = makers[shape](renderer, size)
            n = len(turns)
            sample = {n // 4, n // 2} | set(range(n - 5, n))
            for policy in policies:
                rows = time_turns(
                    policy, renderer, turns, TOOLS, sample, args.repeats, not args.no_full
                )
                table(f"{shape}, grown to {size} tokens, policy {policy}", rows)
                last = rows[-5:]
                summary.append(
                    {
                        "shape": shape,
                        "size": size,
                        "policy": policy,
                        "first_message_chars": len(turns[-1][0]["content"]),
                        "conversation_tokens": last[-1]["conversation_tokens"],
                        "full_ms_median": statistics.median(r["full_ms"] for r in last),
                        "incremental_ms_median": statistics.median(
                            r["incremental_ms"] for r in last
                        ),
                        "incremental_cpu_ms_median": statistics.median(
                            r["incremental_cpu_ms"] for r in last
                        ),
                        "turns": rows,
                    }
                )
    print(
        f"\n{'shape':>6} {'size':>6} {'policy':>32} {'conv tok':>8} {'msg0 chars':>10} "
        f"{'full ms':>8} {'incr ms':>8} {'incr cpu':>8} {'target':>7}"
    )
    for r in summary:
        if r["size"] == args.target_size:
            r["target_met"] = r["incremental_cpu_ms_median"] <= args.target_ms
        verdict = "" if "target_met" not in r else "holds" if r["target_met"] else "MISSED"
        print(
            f"{r['shape']:>6} {r['size']:>6} {r['policy']:>32} {r['conversation_tokens']:>8} "
            f"{r['first_message_chars']:>10} {r['full_ms_median']:>8.1f} "
            f"{r['incremental_ms_median']:>8.2f} {r['incremental_cpu_ms_median']:>8.2f} "
            f"{verdict:>7}"
        )
    load1 = os.getloadavg()
    print(
        "(medians of the last five turns; best of --repeats per turn; cpu: the thread's; target: "
        f"median cpu <= {args.target_ms:g} ms at {args.target_size} tokens)\n"
        f"load average (1, 5, 15 min): {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} before, "
        f"{load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} after, on {os.cpu_count()} cores"
    )
    out["synthetic"] = summary
    out["load_average"] = {"before": load0, "after": load1}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
