"""A scripted client: cache a sequence, splice it (AMORTIZE), and show the next request hit.

python experiments/backend/splice_demo.py                 # starts the embedded default
python experiments/backend/splice_demo.py --backend URL   # or uses a running leyline serve
"""

from __future__ import annotations

import argparse
import json
import random
import uuid
from contextlib import ExitStack

from leyline_agent import Directive, apply_directives
from leyline_agent.backends.sglang.launch import EmbeddedServer
from leyline_agent.client import LeylineClient


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", help="URL of a running leyline serve")
    ap.add_argument("--length", type=int, default=512)
    args = ap.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(1000, 150000) for _ in range(args.length)]
    with ExitStack() as stack:
        client = LeylineClient(args.backend or stack.enter_context(EmbeddedServer()).url)
        ns = f"demo-{uuid.uuid4().hex[:8]}"
        first = client.generate(tokens, extra_key=ns)
        print(f"1. prefill {first.prompt_tokens} tokens: cached {first.cached_tokens}")
        d = Directive(start=100, end=300, replacement=(rng.randrange(1000, 150000),) * 8)
        res = client.splice(tokens, [d], extra_key=ns)
        print(f"2. splice [100, 300) -> 8 tokens: {res.model_dump()}")
        new = apply_directives(tokens, [d])
        after = client.generate(new + [42], extra_key=ns)
        print(f"3. next request ({after.prompt_tokens} tokens): cached {after.cached_tokens}")
        baseline = client.generate(new + [42], extra_key=f"{ns}-cold")
        print(f"   same request in a cold namespace: cached {baseline.cached_tokens}")
        print(json.dumps({"spliced_cached": after.cached_tokens, "new_length": len(new)}))


if __name__ == "__main__":
    main()
