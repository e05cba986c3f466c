"""Two ``leyline serve`` workers behind ``smg --policy consistent_hashing``, the proxy in front, the
real ``openai`` client: six sessions x six turns (edits from the fourth), one worker killed after
four turns; prints sessions per worker, spliced turns and splice misses before and after the kill,
and writes them to ``runs/scale_out/gateway.json`` (issue 28's figures).

    .venv/bin/python experiments/scale_out/gateway_run.py   # ~4 min on 2 cores (two worker starts)
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from gateway import gateway, routed, served, worker_id, workers  # noqa: E402
from test_proxy import serve_proxy  # noqa: E402

from leyline_agent.proxy.identity import SessionKey  # noqa: E402
from leyline_agent.testing.soak import TOOLS, turn_messages  # noqa: E402

POLICY, TURNS, SESSIONS, KILL_AFTER = "stale_tool_outputs:keep_last=2", 6, 6, 4


def chat(proxy: str, name: str, messages: list[dict[str, Any]], model: str) -> None:
    client = openai.OpenAI(
        base_url=proxy + "/v1", api_key="unused", max_retries=0, timeout=600,
        default_headers={"X-Leyline-Session": name},
    )  # fmt: skip
    client.chat.completions.create(
        model=model,
        messages=messages,
        tools=TOOLS,
        max_tokens=2,
        temperature=0,  # type: ignore[arg-type]
    )


def phase(records: dict[str, list[dict[str, Any]]], turns: range) -> dict[str, int]:
    rows = [r for rec in records.values() for r in rec if r["turn"] in turns]
    edited = [r for r in rows if r["edited"]]
    return {
        "turns": len(rows),
        "edited": len(edited),
        "spliced": sum(r["spliced"] for r in edited),
        "misses": sum(1 for r in edited if r["splice_error"] is not None),
        "reasons": dict(Counter(r["splice_miss_reason"] for r in edited if r["splice_error"])),
    }


def main() -> None:
    out: dict[str, Any] = {}
    with workers(2) as (a, b), gateway([a.url, b.url], Path("/tmp/smg_gateway.log")) as url:
        ids = {worker_id(a.url): "a", worker_id(b.url): "b"}
        names = [f"gw-{i}" for i in range(SESSIONS)]
        home = {n: ids[routed(url, SessionKey("default", "header", n).namespace)] for n in names}
        out["sessions_per_worker"] = dict(Counter(home.values()))
        history = {n: turn_messages(200 + i, TURNS, 6) for i, n in enumerate(names)}
        with serve_proxy(url, POLICY, share_exact=True) as proxy:
            model = served(proxy)

            def run_turn(t: int) -> None:
                with ThreadPoolExecutor(len(names)) as pool:
                    list(pool.map(lambda n: chat(proxy, n, history[n][t], model), names))

            t0 = time.perf_counter()
            for t in range(KILL_AFTER):
                run_turn(t)
            b.stop()
            for t in range(KILL_AFTER, TURNS):
                run_turn(t)
            out["wall_s"] = round(time.perf_counter() - t0, 1)
            records = {
                n: httpx.get(f"{proxy}/leyline/sessions/{n}", timeout=30).json()["records"]
                for n in names
            }
        out["before_kill"] = phase(records, range(KILL_AFTER))
        out["after_kill"] = phase(records, range(KILL_AFTER, TURNS))
        out["moved_sessions"] = sum(1 for n in names if home[n] == "b")
    print(json.dumps(out, indent=2))
    path = Path("runs/scale_out/gateway.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
