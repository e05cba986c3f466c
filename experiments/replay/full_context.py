"""A replay's spliced turns against the unedited full context (the `none` arm's prompt).

`leyline replay --agreement` compares the splice arm's first token with an exact prefill of the
*edited* prompt. This script adds the third path of the paper's §4.3 for the same turns: the
*unedited* turn (the recorded messages, cut as the run cut them, no policy), prefilled in one
namespace per trace, greedy first token and its top-2 margin. It reads the run's
``results.json`` (traces, ``--cap-chars``, ``--max-turns``, model) and needs the backend the run
used, or one serving the same model.

    python experiments/replay/full_context.py runs/replay/results.json --backend URL

Prints, per spliced turn with a reference, the three first tokens (full context, AMORTIZE, the
exact edited prefill) and the full context's margin; then how often AMORTIZE and the exact edited
prefill equal the full context's token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from leyline_agent.chat.model_dir import load_renderer
from leyline_agent.client import LeylineClient
from leyline_agent.messages import flatten
from leyline_agent.policies import parse_policy
from leyline_agent.replay.runner import top_margin
from leyline_agent.traces import load
from leyline_agent.wrapper import ConversationWrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    a = ap.parse_args()
    doc = json.loads(a.results.read_text())
    args = doc["arguments"]
    renderer = load_renderer(args["model_path"])
    traces = {t.name: t for p in args["traces"] for t in load(p) if t.turns}
    level = str(min(int(k) for k in doc["levels"]))
    checked = {
        (t["trace"], t["turn"]): t
        for t in doc["turns"]
        if t["arm"] == "splice" and str(t["level"]) == level and t["reference_token"] is not None
    }
    client = LeylineClient(a.backend)
    rows = []
    for name in sorted({tr for tr, _ in checked}):
        trace = traces[name]
        wrapper = ConversationWrapper(renderer, parse_policy("none"))
        for i, messages in enumerate(trace.turns[: args["max_turns"]]):
            cap = args.get("cap_chars")
            plan = wrapper.plan(flatten(messages, cap) if cap else messages, trace.tools)
            wrapper.commit(plan)
            row = checked.get((name, i))
            if row is None:
                continue
            res = client.generate(plan.tokens, extra_key=f"fullctx:{name}", top_logprobs=2)
            full = res.output_ids[0]
            rows.append(
                {"trace": name, "turn": i, "full": full, "full_margin": top_margin(res.meta),
                 "amortize": row["first_token"], "exact_edited": row["reference_token"],
                 "exact_margin": row["reference_margin"]}
            )  # fmt: skip
            r = rows[-1]
            print(
                f"{name} t{i}: full {renderer.tokenizer.decode([full])!r} "
                f"(margin {r['full_margin']:.3f}) amortize "
                f"{renderer.tokenizer.decode([r['amortize']])!r} exact edited "
                f"{renderer.tokenizer.decode([r['exact_edited']])!r}",
                flush=True,
            )
    n = len(rows)
    am = sum(r["amortize"] == r["full"] for r in rows)
    ex = sum(r["exact_edited"] == r["full"] for r in rows)
    both = sum(r["amortize"] == r["exact_edited"] for r in rows)
    changed = [r for r in rows if r["exact_edited"] != r["full"]]
    kept = sum(r["amortize"] == r["full"] for r in changed)
    print(
        f"level {level}: {n} spliced turns; AMORTIZE = full context {am}/{n}, exact edited = "
        f"full context {ex}/{n}, AMORTIZE = exact edited {both}/{n}; where the edit changed the "
        f"exact token ({len(changed)}), AMORTIZE kept the full context's in {kept}"
    )
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
