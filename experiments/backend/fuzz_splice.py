"""Seeded splice fuzzing against a real ``leyline serve`` with a small pool (issue 11).

    python experiments/backend/fuzz_splice.py --ops 10000 --pool 1536 --seeds 1
    python experiments/backend/fuzz_splice.py --ops 10000 --pool 2048 --page-size 16

Starts a server (embedded default, debug endpoints, ``--max-total-tokens POOL``) unless
``--backend URL`` is given, runs ``SpliceFuzzer`` (``leyline_agent/testing/splice_fuzz.py``) and
checks the idle invariants after every operation and KV rows on every ``--check-rows-every``-th
splice. A failure prints the seed and step (make it a regression test). Prints a table, writes
``runs/fuzz_splice/results.json``; the last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from leyline_agent.embedded.model import EMBEDDED
from leyline_agent.testing.splice_fuzz import InvariantBroken, SpliceFuzzer

EMBEDDED_CONFIG = EMBEDDED.to_hf()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=10000, help="operations per seed")
    ap.add_argument("--seeds", type=str, default="1", help="comma-separated seeds")
    ap.add_argument("--pool", type=int, default=1536, help="KV pool size in tokens")
    ap.add_argument("--max-reply", type=int, default=16, help="longest generated reply")
    ap.add_argument("--check-rows-every", type=int, default=10)
    ap.add_argument("--backend", type=str, default=None, help="URL of a running server")
    ap.add_argument("--page-size", type=int, default=1, help="the server's --page-size")
    ap.add_argument("--out", type=Path, default=Path("runs/fuzz_splice"))
    args = ap.parse_args()

    from leyline_agent.backends.sglang.launch import EmbeddedServer

    srv = None
    url = args.backend
    if url is None:
        srv = EmbeddedServer(
            max_total_tokens=args.pool,
            env={"LEYLINE_DEBUG_ENDPOINTS": "1"},
            extra_args=["--page-size", str(args.page_size)] if args.page_size > 1 else [],
        )
        url = srv.start().url
    results, failed = [], None
    t0 = time.perf_counter()
    try:
        for seed in [int(s) for s in args.seeds.split(",")]:
            fz = SpliceFuzzer(
                url,
                seed,
                config=EMBEDDED_CONFIG,
                check_rows_every=args.check_rows_every,
                max_reply=args.max_reply,
                page=args.page_size,
            )
            t = time.perf_counter()

            def progress(i: int, t: float = t, seed: int = seed) -> None:
                if i % 250 == 0:
                    rate = i / (time.perf_counter() - t)
                    print(f"seed {seed}: {i}/{args.ops} ops ({rate:.1f} ops/s)", flush=True)

            try:
                fz.run(args.ops, progress)
            except InvariantBroken as e:
                failed = str(e)
                print(f"FAILED: {e}", flush=True)
            rep = fz.report.as_dict() | {"seconds": round(time.perf_counter() - t, 1)}
            results.append(rep)
            fz.close()
            if failed:
                break
    finally:
        if srv is not None:
            srv.stop()
    summary = {
        "ops": sum(r["steps"] for r in results),
        "failed": failed,
        "pool": args.pool,
        "page_size": args.page_size,
        "seconds": round(time.perf_counter() - t0, 1),
        "runs": results,
    }
    print(f"{'seed':>6} {'ops':>7} {'splices ok':>10} {'409/503':>8} {'rows checked':>13} {'s':>7}")
    for r in results:
        st = r["statuses"]
        refused = st.get("splice 409", 0) + st.get("splice 503", 0)
        print(
            f"{r['seed']:>6} {r['steps']:>7} {st.get('splice 200', 0):>10} {refused:>8} "
            f"{r['rows_checked']:>13} {r['seconds']:>7}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
