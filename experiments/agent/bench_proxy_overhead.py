"""The proxy's added latency per request, end to end: the same chat request sent straight to the
backend and through ``leyline proxy``, with the real ``openai`` client.

A tool-calling conversation grows one turn (assistant tool call + tool output + user nudge) per
request until it holds ``--target`` tokens. Every turn's message list is sent twice: to the
backend's ``/v1/chat/completions`` and to the proxy's, each path in its own cache namespace, so
both reuse the previous turn's prefix and prefill only the new turn. With ``--policy none`` (the
default) the proxy edits nothing, so the two requests have the same prompt and the difference is
the proxy's own cost: session matching, turn planning (render, tokenize, diff), forwarding.

    .venv/bin/python experiments/agent/bench_proxy_overhead.py [--backend URL] [--target 32000]

Without ``--backend`` it starts ``leyline serve`` (the embedded default). Prints a table per
history-length bucket (median direct ms, median via-proxy ms, added ms) and, as the last stdout
line, JSON ``{"buckets": [...], "overall_added_ms_median": ..., ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_planning import TOOLS  # the same one-tool (bash) schema as the planning bench
from openai import OpenAI

from leyline_agent.backends.sglang.launch import ServerError, free_port, read_tail, wait_healthy

WORDS = "file line error test module import value return class def self path output".split()


def start(argv: list[str], url: str, timeout: float = 600.0) -> subprocess.Popen[bytes]:
    """Start ``leyline ARGV`` and wait until ``URL/health`` answers 200."""
    log = Path(tempfile.mkstemp(prefix="bench-proxy-", suffix=".log")[1])
    with log.open("wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "leyline_agent.cli", *argv], stdout=f, stderr=subprocess.STDOUT
        )
    try:
        wait_healthy(
            url,
            proc,
            timeout,
            name=f"leyline {argv[0]}",
            log_tail=lambda: f"{read_tail(log)}\nlog: {log}",
        )
    except ServerError:
        proc.kill()
        raise
    return proc


def tool_output(rng: random.Random, n_words: int) -> str:
    return "\n".join(
        " ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(max(1, n_words // 12))
    )


def timed(client: OpenAI, messages: list[dict], **extra: object) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = client.chat.completions.create(
        model="default",
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=1,
        temperature=0,
        **extra,  # type: ignore[arg-type]
    )
    ms = (time.perf_counter() - t0) * 1e3
    return ms, int(r.usage.prompt_tokens if r.usage else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", help="a running leyline serve URL (default: start one)")
    ap.add_argument("--policy", default="none")
    ap.add_argument("--target", type=int, default=32000, help="history tokens to grow to")
    ap.add_argument("--words-per-output", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    procs: list[subprocess.Popen[bytes]] = []
    try:
        backend = args.backend
        if not backend:
            port = free_port()
            backend = f"http://127.0.0.1:{port}"
            procs.append(start(["serve", "--port", str(port)], backend))
        pport = free_port()
        proxy_url = f"http://127.0.0.1:{pport}"
        procs.append(
            start(
                ["proxy", "--backend", backend, "--policy", args.policy, "--port", str(pport)],
                proxy_url,
                timeout=120,
            )
        )
        direct = OpenAI(base_url=backend + "/v1", api_key=os.environ.get("KEY", "none"))
        proxied = OpenAI(base_url=proxy_url + "/v1", api_key="none")
        rng = random.Random(args.seed)
        run = f"{rng.getrandbits(32):08x}"
        messages: list[dict] = [
            {"role": "system", "content": f"You are a coding agent (run {run})."},
            {"role": "user", "content": "Fix the failing test in the repository."},
        ]
        rows: list[dict] = []
        prompt = 0
        turn = 0
        while prompt < args.target:
            d_ms, prompt = timed(direct, messages, extra_body={"extra_key": f"direct-{run}"})
            p_ms, p_prompt = timed(proxied, messages, extra_headers={"X-Leyline-Session": run})
            if turn > 0:  # the first turn is a cold prefill on both paths
                rows.append({"prompt": prompt, "direct_ms": d_ms, "proxy_ms": p_ms})
            print(
                f"turn {turn:3d}  prompt {prompt:6d} tok  direct {d_ms:7.1f} ms  "
                f"proxy {p_ms:7.1f} ms  (proxy saw {p_prompt})",
                flush=True,
            )
            call = {
                "id": f"call_{turn}",
                "type": "function",
                "function": {"name": "bash", "arguments": json.dumps({"cmd": f"pytest -x {turn}"})},
            }
            messages += [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {
                    "role": "tool",
                    "tool_call_id": f"call_{turn}",
                    "content": tool_output(rng, args.words_per_output),
                },
                {"role": "user", "content": "Continue."},
            ]
            turn += 1
    finally:
        for p in reversed(procs):
            p.kill()
            p.wait()

    edges = [0, 4000, 8000, 16000, 32000, 64000, 10**9]
    buckets = []
    print(f"\n{'history':>15}  {'turns':>5}  {'direct ms':>9}  {'proxy ms':>9}  {'added ms':>8}")
    for lo, hi in zip(edges, edges[1:], strict=False):
        sel = [r for r in rows if lo <= r["prompt"] < hi]
        if not sel:
            continue
        d = statistics.median(r["direct_ms"] for r in sel)
        p = statistics.median(r["proxy_ms"] for r in sel)
        added = statistics.median(r["proxy_ms"] - r["direct_ms"] for r in sel)
        buckets.append(
            {
                "from": lo,
                "to": hi,
                "turns": len(sel),
                "direct_ms": d,
                "proxy_ms": p,
                "added_ms": added,
            }
        )
        print(f"{lo:>6}–{min(hi, 10**6):<7}  {len(sel):>5}  {d:>9.1f}  {p:>9.1f}  {added:>8.1f}")
    out = {
        "policy": args.policy,
        "turns": len(rows),
        "max_prompt_tokens": max((r["prompt"] for r in rows), default=0),
        "overall_added_ms_median": statistics.median(r["proxy_ms"] - r["direct_ms"] for r in rows)
        if rows
        else None,
        "buckets": buckets,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
