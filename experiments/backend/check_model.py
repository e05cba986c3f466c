"""Run the splice mechanics checks on a model: AMORTIZE rows exact, FORGET == fresh prefill, bad
input refused without change (``leyline_agent/testing/model_check.py``).

    .venv/bin/python experiments/backend/check_model.py --model-path DIR     # any config
    .venv/bin/python experiments/backend/check_model.py --family glm4        # a tiny built-in one
    .venv/bin/python experiments/backend/check_model.py --backend URL        # a running server

A model directory is served with dummy weights (``--dummy``; ``--real-weights`` loads them) on a
4,096-token pool; the server needs ``LEYLINE_DEBUG_ENDPOINTS=1`` (set here, or by you for
``--backend``). Prints a table, then one JSON document as the last line. Exit status 1 when a
check fails or the server refuses the splice (the reason is printed).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import httpx

from leyline_agent.testing.model_check import run_all
from leyline_agent.testing.tiny_models import FAMILIES, write_tiny_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-path", type=Path, help="Hugging Face model directory")
    src.add_argument("--family", choices=sorted(FAMILIES), help="write a tiny config and serve it")
    src.add_argument("--backend", help="URL of a running leyline serve (debug endpoints on)")
    ap.add_argument("--real-weights", action="store_true", help="load the weights (no --dummy)")
    ap.add_argument("--max-total-tokens", type=int, default=4096)
    ap.add_argument("extra", nargs="*", help="SGLang arguments after --, e.g. -- --dtype float16")
    args = ap.parse_args()

    if args.backend:
        return report(args.backend, "backend")
    from leyline_agent.backends.sglang.launch import EmbeddedServer

    path = args.model_path
    if args.family:
        path = write_tiny_model(Path(tempfile.mkdtemp(prefix=f"{args.family}-")), args.family)
    extra = ([] if args.real_weights else ["--dummy"]) + args.extra
    with EmbeddedServer(
        model_path=path,
        max_total_tokens=args.max_total_tokens,
        extra_args=extra,
        env={"LEYLINE_DEBUG_ENDPOINTS": "1"},
    ) as srv:
        return report(srv.url, str(path))


def report(url: str, name: str) -> int:
    result: dict[str, object] = {"model": name}
    with httpx.Client(base_url=url, timeout=600) as c:
        try:
            result.update(run_all(c))
            result["ok"] = True
        except AssertionError as e:
            result.update(ok=False, error=str(e))
    for k, v in result.items():
        print(f"{k:<22} {v}")
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
