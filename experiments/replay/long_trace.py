"""Write a long, realistic agent trace (OpenAI messages, JSONL) for ``leyline replay``.

    python experiments/replay/long_trace.py --turns 50 --out runs/long_trace/trace.jsonl
    leyline replay runs/long_trace/trace.jsonl --concurrency 1

A 50-step debugging session: each step the agent calls ``view`` on a source file and the tool
returns ~1,000 tokens of real Python (read from the installed packages, so nothing is downloaded),
the way debug-gym's ``view`` tool does. The last turn's full prompt is about 52k tokens (the size
of a real 50-step debug-gym run), which the embedded default's 131k context holds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "view",
            "description": "Show a file of the repository with line numbers.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "start": {"type": "integer"}},
                "required": ["path"],
            },
        },
    }
]


def sources(root: Path, n: int, chars: int) -> list[tuple[str, str]]:
    """``n`` chunks of about ``chars`` characters of real Python from ``root``, with line numbers."""
    out: list[tuple[str, str]] = []
    for f in sorted(root.rglob("*.py")):
        text = f.read_text(errors="replace")
        if len(text) < chars:
            continue
        lines, body = text.splitlines(), []
        for i, line in enumerate(lines, 1):
            body.append(f"{i:5d}  {line}")
            if sum(len(b) + 1 for b in body) >= chars:
                break
        out.append((str(f.relative_to(root)), "\n".join(body)))
        if len(out) == n:
            return out
    raise SystemExit(f"not enough source files under {root}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--chars", type=int, default=3600, help="characters per tool output")
    ap.add_argument("--out", type=Path, default=Path("runs/long_trace/trace.jsonl"))
    args = ap.parse_args()
    import httpx  # any installed package with enough source

    root = Path(httpx.__file__).resolve().parents[1]
    chunks = sources(root, args.turns, args.chars)
    msgs = [
        {"tools": TOOLS},
        {
            "role": "system",
            "content": "You are a debugging agent. Use the view tool to read code, then fix it.",
        },
        {"role": "user", "content": "The test suite fails with a KeyError. Find the bug."},
    ]
    for step, (path, body) in enumerate(chunks):
        call = {
            "id": f"call_{step}",
            "type": "function",
            "function": {"name": "view", "arguments": json.dumps({"path": path})},
        }
        msgs.append({"role": "assistant", "content": f"Let me read {path}.", "tool_calls": [call]})
        msgs.append({"role": "tool", "tool_call_id": call["id"], "content": body})
    msgs.append({"role": "assistant", "content": "I found the bug."})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(m) + "\n" for m in msgs))
    print(json.dumps({"out": str(args.out), "turns": args.turns + 1, "messages": len(msgs) - 1}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
