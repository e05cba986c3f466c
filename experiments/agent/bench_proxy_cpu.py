"""The proxy's own CPU per request, without a backend: where ``bench_proxy_overhead.py``'s added
latency goes when the backend's time is taken out.

The same conversation (an assistant tool call, a ``--words-per-output`` tool output and a user
nudge per turn) grows to ``--target`` tokens; every turn's body goes through what the proxy does
with it: ``parse`` (the request JSON), ``precheck`` (``serve_turn``'s check before it finds the
session), ``prepare`` (``chat_turn.prepare``: request checks, view,
policy and plan; no splice is sent for appended turns under ``--policy none``), ``forward_json``
(the body to the backend), ``answer_parse`` (the backend's answer, with the prompt token ids on
the turns the proxy asks for them: ``chat_turn.render_check``), ``complete``
(``chat_turn.complete``: usage, the ids compared where asked, the turn recorded).
``backend_json`` is the backend's own cost of writing its answer (not the proxy's, so not in
``proxy_total``). Loopback hops are not counted. Parts are the handling thread's CPU time
(``time.thread_time``: a loaded machine's waiting does not count); ``wall_total`` is the wall clock
of the proxy's parts.

    .venv/bin/python experiments/agent/bench_proxy_cpu.py [--target 34000] [--policy none]

Prints the median milliseconds per part by history bucket, then JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from bench_planning import TOOLS
from bench_proxy_overhead import tool_output

from leyline_agent import chat_turn
from leyline_agent.chat.model_dir import load_renderer
from leyline_agent.chat.request import may_hold_surrogates, request_error
from leyline_agent.client import LeylineClient
from leyline_agent.proxy import fastjson
from leyline_agent.session import SessionCore
from leyline_agent.wrapper import ConversationWrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=int, default=34000)
    ap.add_argument("--policy", default="none")
    ap.add_argument("--words-per-output", type=int, default=600)
    args = ap.parse_args()

    renderer = load_renderer()
    _ = renderer.incremental_checks
    core = SessionCore(
        # NOTE: no backend at this address; gateway=False: not asked (unreachable: every turn)
        LeylineClient("http://127.0.0.1:9", gateway=False),
        ConversationWrapper(renderer, args.policy),
    )
    rng = random.Random(0)
    messages: list[dict] = [
        {"role": "system", "content": "You are a coding agent (run 1)."},
        {"role": "user", "content": "Fix the failing test in the repository."},
    ]
    rows: list[tuple[int, dict[str, float]]] = []
    prompt = turn = checked = 0
    while prompt < args.target:
        body = {"model": "default", "messages": messages, "tools": TOOLS, "max_tokens": 1}
        raw = json.dumps(body).encode()
        w0 = time.perf_counter()
        marks = {"start": time.thread_time()}
        parsed = fastjson.loads(raw)
        marks["parse"] = time.thread_time()
        assert request_error(parsed, text=may_hold_surrogates(raw)) is None  # serve_turn's
        marks["precheck"] = time.thread_time()
        ct = chat_turn.prepare(core, parsed)
        marks["prepare"] = time.thread_time()
        fastjson.dumps(ct.body)
        marks["forward_json"] = time.thread_time()
        ids = ct.pending.plan.tokens
        choice = {"index": 0, "message": {"role": "assistant", "content": "a"}}
        choice["finish_reason"] = "length"
        if ct.body.get("return_prompt_token_ids"):  # the turns chat_turn.render_check picks
            choice["prompt_token_ids"] = ids
            checked += 1
        answer = {
            "id": "x",
            "object": "chat.completion",
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": 1,
                "prompt_tokens_details": {"cached_tokens": max(len(ids) - 800, 0)},
            },
        }
        raw_answer = json.dumps(answer).encode()
        marks["backend_json"] = time.thread_time()
        data = fastjson.loads(raw_answer)
        marks["answer_parse"] = time.thread_time()
        chat_turn.complete(core, ct, data, request_ms=1.0, prompt_ids=ct.prompt_ids(data))
        marks["complete"] = time.thread_time()
        json.dumps(data)
        marks["client_json"] = time.thread_time()
        stamps = list(marks.items())
        ms = {k: (t - stamps[i][1]) * 1e3 for i, (k, t) in enumerate(stamps[1:])}
        ms["proxy_total"] = sum(v for k, v in ms.items() if k != "backend_json")
        ms["wall_total"] = (time.perf_counter() - w0) * 1e3 - ms["backend_json"]
        prompt = len(ids)
        if turn:
            rows.append((prompt, ms))
        call = {
            "id": f"call_{turn}",
            "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"cmd": f"pytest -x {turn}"})},
        }
        messages = [
            *messages,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {
                "role": "tool",
                "tool_call_id": call["id"],
                "content": tool_output(rng, args.words_per_output),
            },
            {"role": "user", "content": "Continue."},
        ]
        turn += 1
    out = []
    for lo, hi in ((0, 8000), (8000, 16000), (16000, 32000), (32000, 10**9)):
        sel = [m for p, m in rows if lo <= p < hi]
        if sel:
            med = {k: round(statistics.median(m[k] for m in sel), 2) for k in sel[0]}
            out.append({"from": lo, "to": hi, "turns": len(sel), **med})
            print(
                f"{lo:>6}-{min(hi, 10**6):<7} {len(sel):3d} turns  "
                + "  ".join(f"{k} {v:.2f}" for k, v in med.items())
            )
    print(f"{checked} of {turn} turns asked the backend for the prompt ids")
    print(
        json.dumps({"policy": args.policy, "buckets": out, "ids_checked": checked, "turns": turn})
    )


if __name__ == "__main__":
    main()
