"""Sharing, pins and forks (issue 16), three figures on a real ``leyline serve``:

(a) **sharing**: tokens prefilled by ``--sessions`` (8) concurrent agent sessions whose prompts
    start with the same ``--system-tokens`` (4k) system prompt, each a few tool-calling turns under
    ``stale_tool_outputs:keep_last=1`` (the policy edits from the third turn on, so sessions
    splice and go private). Arms, each under a ``cache_salt`` of its own (no arm reuses another's
    KV): ``sglang`` (plain SGLang: the full history straight to ``/v1/chat/completions``, no
    namespace, no policy), ``before`` (Leyline, ``share_exact=False``: every session in its own
    namespace), ``after`` (Leyline, exact KV shared until the first splice).
(b) **pins**: ``--pin-sessions`` (16) sessions, each with a system prompt of its own, take turns
    round-robin; between rounds (the idle gap while their tools run) other traffic of
    ``--flood-tokens`` goes through a small pool (``--pool-b``); hit rate of the turns after the
    first, without and with ``cache_control`` markers (each turn pins the session's prompt, TTL 5m).
(c) **fork**: the time ``POST /leyline/fork`` takes to copy a private session's KV of L tokens
    into a new namespace, against prefilling the same L tokens cold.

    .venv/bin/python experiments/agent/bench_sharing.py [--backend URL] [--backend-b URL]

Without ``--backend`` it starts the embedded default (``EmbeddedServer``, pool ``--pool-a``) for
(a) and (c), then one with ``--pool-b`` for (b) (one at a time). Prints a table per figure and, as
the last stdout line, JSON with every figure, the machine and the commit.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
from bench_planning import TOOLS  # the same one-tool (bash) schema as the planning bench

from leyline_agent import LeylineSession
from leyline_agent.backends.sglang.launch import EmbeddedServer
from leyline_agent.chat.model_dir import load_renderer
from leyline_agent.client import LeylineClient
from leyline_agent.runinfo import git_commit, machine

POLICY = "stale_tool_outputs:keep_last=1"
WORDS = "file line error test module import value return class def self path output".split()


def text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of code-like text (the embedded o200k tokenizer)."""
    return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(tokens // 2))


def conversation(
    system: str, task: str, rng: random.Random, turns: int, output_tokens: int
) -> list[list[dict[str, Any]]]:
    """Per turn, the full message list: system, task, then one tool call + output per step."""
    history: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": task},
    ]
    out = [list(history)]
    for step in range(1, turns):
        call = {
            "id": f"call_{step}",
            "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"cmd": f"pytest -x {step}"})},
        }
        history += [
            {"role": "assistant", "content": f"Step {step}.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": text(rng, output_tokens)},
        ]
        out.append(list(history))
    return out


@contextmanager
def backend(url: str | None, pool: int) -> Iterator[str]:
    if url:
        yield url
        return
    with EmbeddedServer(max_total_tokens=pool) as srv:
        yield srv.url


# --- (a) sharing ------------------------------------------------------------------------------


def run_sglang(url: str, turns: list[list[dict[str, Any]]], salt: str) -> int:
    """Plain SGLang: every turn's full history, no namespace; tokens prefilled."""
    prefilled = 0
    with httpx.Client(base_url=url, timeout=600) as http:
        for messages in turns:
            body = {"model": "default", "messages": messages, "tools": TOOLS, "max_tokens": 1,
                    "temperature": 0, "cache_salt": salt}  # fmt: skip
            r = http.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            usage = r.json()["usage"]
            prefilled += usage["prompt_tokens"] - (
                (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            )
    return prefilled


def run_leyline(url: str, turns: list[list[dict[str, Any]]], salt: str, share: bool) -> int:
    with LeylineSession(url, POLICY, share_exact=share) as s:
        for messages in turns:
            s.chat(messages, tools=TOOLS, max_tokens=1, temperature=0, cache_salt=salt)
        return sum(r.prefilled_tokens for r in s.records)


def figure_sharing(url: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    system = f"[{uuid.uuid4().hex[:8]}] You are a coding agent. " + text(rng, args.system_tokens)
    convos = [
        conversation(system, f"Task {i}: fix test_{i}.", rng, args.turns, args.output_tokens)
        for i in range(args.sessions)
    ]
    system_tokens = load_renderer(None).count(system)
    arms: dict[str, Callable[[list[list[dict[str, Any]]], str], int]] = {
        "sglang": lambda t, salt: run_sglang(url, t, salt),
        "before": lambda t, salt: run_leyline(url, t, salt, share=False),
        "after": lambda t, salt: run_leyline(url, t, salt, share=True),
    }
    rows = {}
    for arm, run in arms.items():
        salt = f"bench-{arm}-{uuid.uuid4().hex[:8]}"
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=args.sessions) as pool:
            prefilled = list(pool.map(lambda c, s=salt, r=run: r(c, s), convos))
        rows[arm] = {"prefilled_tokens": sum(prefilled), "wall_s": time.perf_counter() - t0}
        print(f"(a) {arm:7s} prefilled {sum(prefilled):8d} tokens  "
              f"{rows[arm]['wall_s']:6.1f} s", flush=True)  # fmt: skip
    return {"system_tokens": system_tokens, "sessions": args.sessions, "turns": args.turns, **rows}


# --- (b) pins ---------------------------------------------------------------------------------


def mark_last(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = [dict(m) for m in messages]
    out[-1]["cache_control"] = {"type": "ephemeral", "ttl": "5m"}
    return out


def figure_pins(url: str, args: argparse.Namespace) -> dict[str, Any]:
    rows = {}
    for pinned in (False, True):
        rng = random.Random(args.seed + 1)
        salt = f"bench-pins-{pinned}-{uuid.uuid4().hex[:8]}"
        convos = [
            conversation(f"[{uuid.uuid4().hex[:8]}] Agent {i}. " + text(rng, args.pin_system),
                         f"Task {i}.", rng, args.pin_turns, args.pin_output)
            for i in range(args.pin_sessions)
        ]  # fmt: skip
        sessions = [LeylineSession(url, "none") for _ in convos]
        flood = LeylineClient(url)
        refused = 0
        for t in range(args.pin_turns):
            for s, c in zip(sessions, convos, strict=True):
                messages = mark_last(c[t]) if pinned else c[t]
                s.chat(messages, tools=TOOLS, max_tokens=1, temperature=0, cache_salt=salt)
                refused += s.pin_error is not None
            time.sleep(args.gap_s)
            for _ in range(args.flood_tokens // 1000):  # other traffic while the tools run
                ids = [rng.randrange(1000, 150000) for _ in range(1000)]
                flood.generate(ids, extra_key=f"flood-{uuid.uuid4().hex}")
        later = [r for s in sessions for r in s.records[1:]]
        prompt = sum(r.prompt_tokens for r in later)
        reused = sum(r.reused_tokens for r in later)
        pinned_slots = flood.stats().get("pinned_slots")
        for s in sessions:
            s.close()
        flood.close()
        arm = "pins" if pinned else "no_pins"
        rows[arm] = {"hit_rate": reused / prompt, "reused_tokens": reused,
                     "prompt_tokens": prompt, "pins_refused": refused,
                     "pinned_slots_at_end": pinned_slots}  # fmt: skip
        print(f"(b) {arm:7s} hit rate {reused / prompt:6.1%} ({reused}/{prompt}), "
              f"pins refused {refused}, pinned slots {pinned_slots}", flush=True)  # fmt: skip
    return rows


# --- (c) fork ---------------------------------------------------------------------------------


def figure_fork(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with LeylineClient(url) as c:
        for length in args.fork_lengths:
            rng = random.Random(length)
            ids = [rng.randrange(1000, 150000) for _ in range(length)]
            src = f"bench-fork-src-{uuid.uuid4().hex[:8]}"
            c.generate(ids, extra_key=src)
            forks = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                out = c.fork(ids, extra_key=src, target_extra_key=f"bench-fork-{uuid.uuid4().hex}")
                forks.append(((time.perf_counter() - t0) * 1e3, out.elapsed_ms, out.copied))
            t0 = time.perf_counter()
            cold = c.generate(ids, extra_key=f"bench-cold-{uuid.uuid4().hex}")
            prefill_ms = (time.perf_counter() - t0) * 1e3
            row = {
                "tokens": length,
                "fork_ms": statistics.median(f[0] for f in forks),
                "fork_server_ms": statistics.median(f[1] for f in forks),
                "copied": forks[0][2],
                "prefill_ms": prefill_ms,
                "prefill_cached": cold.cached_tokens,
            }
            row["speedup"] = row["prefill_ms"] / row["fork_ms"]
            rows.append(row)
            print(f"(c) {length:6d} tokens  fork {row['fork_ms']:8.1f} ms "
                  f"(server {row['fork_server_ms']:.1f})  re-prefill {prefill_ms:9.1f} ms  "
                  f"{row['speedup']:6.1f}x", flush=True)  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", help="leyline serve URL for (a) and (c) (default: start one)")
    p.add_argument("--backend-b", help="leyline serve URL with a small pool for (b)")
    p.add_argument("--pool-a", type=int, default=131072)
    p.add_argument("--pool-b", type=int, default=16384)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=4096)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--output-tokens", type=int, default=200)
    p.add_argument("--pin-sessions", type=int, default=16)
    p.add_argument("--pin-system", type=int, default=200)
    p.add_argument("--pin-turns", type=int, default=3)
    p.add_argument("--pin-output", type=int, default=60)
    p.add_argument("--flood-tokens", type=int, default=16000)
    p.add_argument("--gap-s", type=float, default=0.5)
    p.add_argument("--fork-lengths", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1024, 4096, 16384])  # fmt: skip
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="a,b,c", help="figures to run, e.g. 'a,c'")
    args = p.parse_args()
    only = set(args.only.split(","))
    result: dict[str, Any] = {"commit": git_commit(), "machine": machine(), "args": vars(args)}
    if only & {"a", "c"}:
        with backend(args.backend, args.pool_a) as url:
            if "a" in only:
                result["sharing"] = figure_sharing(url, args)
            if "c" in only:
                result["fork"] = figure_fork(url, args)
    if "b" in only:
        with backend(args.backend_b, args.pool_b) as url:
            result["pins"] = figure_pins(url, args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
