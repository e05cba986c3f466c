"""Concurrency soak through the proxy (issue 11): N sessions x T turns in parallel, policy
``stale_tool_outputs:keep_last=2``, a KV pool smaller than the sessions' working set.

    python experiments/backend/soak_proxy.py --sessions 16 --turns 50 --pool 16384

Prints turns, errors, splice misses by reason, p50/p90 turn time and the backend's integrity
verdict; writes ``runs/soak_proxy/results.json``; the last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from leyline_agent.backends.sglang.launch import EmbeddedServer, free_port
from leyline_agent.proxy import create_app
from leyline_agent.testing.invariants import idle_invariants_hold, idle_stats
from leyline_agent.testing.soak import run_soak


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--lines", type=int, default=8, help="lines per tool output (~14 tokens each)")
    ap.add_argument("--pool", type=int, default=16384, help="KV pool size in tokens")
    ap.add_argument("--policy", default="stale_tool_outputs:keep_last=2")
    ap.add_argument("--out", type=Path, default=Path("runs/soak_proxy"))
    args = ap.parse_args()

    t0 = time.perf_counter()
    with EmbeddedServer(max_total_tokens=args.pool) as srv:
        port = free_port()
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(srv.url, args.policy), host="127.0.0.1", port=port, log_level="warning"
            )
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        try:
            fig = run_soak(
                f"http://127.0.0.1:{port}", sessions=args.sessions, turns=args.turns,
                lines=args.lines,
            )  # fmt: skip
        finally:
            server.should_exit = True
            thread.join(timeout=15)
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            st = idle_stats(c)
    fig |= {
        "pool": args.pool,
        "integrity_ok": idle_invariants_hold(st),
        "stats": st,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(f"turns {fig['turns']}  errors {fig['errors'] or 0}  5xx {fig['errors_5xx']}")
    print(
        f"edited {fig['edited_turns']}  spliced {fig['spliced_turns']}  misses "
        f"{fig['splice_misses']} {fig['misses_by_reason']}"
    )
    print(
        f"turn time p50 {fig['p50_s']} s  p90 {fig['p90_s']} s  integrity ok {fig['integrity_ok']}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(fig, indent=2))
    print(json.dumps(fig))
    ok = fig["errors_5xx"] == 0 and fig["integrity_ok"]
    ok = ok and fig["spliced_turns"] + fig["splice_misses"] == fig["edited_turns"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
