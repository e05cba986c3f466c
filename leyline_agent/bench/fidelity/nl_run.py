"""``leyline bench fidelity --model NAME --task nl``: the natural-language carried/direct/control
task (``nl_task.py``) on a served real model, AMORTIZE vs FORGET per group.

Per case, the four paths of ``traces.run_case`` (full context, AMORTIZE splice of the policy's
stub, FORGET splice, fresh prefill of the edited conversation), each greedy for
``NL_TOKENS`` tokens after the answer's start ``KEY: ``. Scored per group with Wilson 95%
intervals: accuracy against the fact's value (the first integer generated equals it), first-token
and answer agreement with the full context, FORGET's tokens equal to the fresh prefill's, and
KL(full || path) at the first position (top-10). Rows go to ``OUT/cases.jsonl`` as they finish;
``python -m leyline_agent.bench.fidelity.nl_run OUT/cases.jsonl`` prints the table again.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from leyline_agent.bench.fidelity import nl_task as nt
from leyline_agent.bench.fidelity import traces as tf

NL_TOKENS = 4
ARMS = ("full", "amortize", "forget", "fresh")


def run_case(client: Any, renderer: Any, case: nt.NLCase) -> dict[str, Any]:
    """One case's four paths (``traces.run_case``) plus its group, fact and decoded answers."""
    spec = replace(tf.TraceFidelitySpec(), new_tokens=NL_TOKENS)
    tcase = tf.Case(f"nl-{case.group}", case.index, nt.POLICY, 0, case.full, case.edited,
                    case.directives)  # fmt: skip
    row = tf.run_case(client, tcase, spec)
    row.update(group=case.group, key=case.key, value=case.value, fact=list(case.fact))
    for arm in ARMS:
        row[f"{arm}_text"] = renderer.decode(row[arm])
        row[f"{arm}_answer"] = nt.answer(row[f"{arm}_text"])
    return row


def _rate(rows: list[dict[str, Any]], pred: Any) -> dict[str, Any]:
    k, n = sum(1 for r in rows if pred(r)), len(rows)
    lo, hi = tf.wilson(k, n)
    return {"k": k, "n": n, "rate": k / n if n else float("nan"), "ci95": [lo, hi]}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per group (and pooled ``real`` = carried + direct, ``control`` = the two controls):
    accuracy of each path against the value, agreement with the full context (first token,
    answer), FORGET = fresh (all tokens), KL medians."""
    pools = {g: [g] for g in nt.GROUPS + nt.EXTRA_GROUPS} | {
        "real": ["carried", "direct"], "control": ["carried_ctrl", "direct_ctrl"]
    }  # fmt: skip
    out: dict[str, Any] = {}
    for name, groups in pools.items():
        rs = [r for r in rows if r["group"] in groups]
        if not rs:
            continue
        s: dict[str, Any] = {f"acc_{a}": _rate(rs, lambda r, a=a: r[f"{a}_answer"] == r["value"])
                             for a in ARMS}  # fmt: skip
        for a in ("amortize", "forget"):
            s[f"{a}_first_eq_full"] = _rate(rs, lambda r, a=a: r[a][:1] == r["full"][:1])
            s[f"{a}_answer_eq_full"] = _rate(
                rs, lambda r, a=a: r[f"{a}_answer"] == r["full_answer"]
            )
            kls = sorted(r[f"kl_{a}"] for r in rs if r[f"kl_{a}"] == r[f"kl_{a}"])
            s[f"kl_{a}_median"] = kls[len(kls) // 2] if kls else float("nan")
        s["forget_eq_fresh"] = _rate(rs, lambda r: r["forget"] == r["fresh"])
        s["amortize_cached_after"] = _rate(
            rs, lambda r: r["amortize_next_cached"] >= r["edited_len"] - 1
        )
        out[name] = s
    return out


def table(summary: dict[str, Any]) -> str:
    """The summary as a Markdown table, one row per group (k/n and Wilson 95% in brackets)."""

    def cell(s: dict[str, Any], ci: bool = True) -> str:
        lo, hi = s["ci95"]
        return (
            f"{s['rate']:.1%}" + (f" [{lo:.1%}, {hi:.1%}]" if ci else "") + f" ({s['k']}/{s['n']})"
        )

    lines = [
        "| group | n | acc full | acc AMORTIZE | acc FORGET | AMORTIZE 1st = full | FORGET 1st = "
        "full | AMORTIZE answer = full | FORGET answer = full | FORGET = fresh | KL(full‖A) / "
        "KL(full‖F) median |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g, s in summary.items():
        lines.append(
            f"| {g} | {s['acc_full']['n']} | {cell(s['acc_full'])} | {cell(s['acc_amortize'])} "
            f"| {cell(s['acc_forget'])} | {cell(s['amortize_first_eq_full'])} "
            f"| {cell(s['forget_first_eq_full'])} | {cell(s['amortize_answer_eq_full'], False)} "
            f"| {cell(s['forget_answer_eq_full'], False)} | {cell(s['forget_eq_fresh'], False)} "
            f"| {s['kl_amortize_median']:.2e} / {s['kl_forget_median']:.2e} |"
        )
    return "\n".join(lines)


def run_nl(
    model_dir: Path,
    out: Path,
    *,
    n: int,
    seed: int = 1,
    backend: str | None = None,
    dtype: str | None = None,
    workers: int = 1,
    groups: Sequence[str] = nt.GROUPS,
) -> dict[str, Any]:
    """``n`` cases per group of ``groups`` (``nl_task.cases``, groups in turn, so a run stopped early holds
    them evenly) on ``backend`` (default: a ``leyline serve`` of ``model_dir`` started here, in
    ``dtype``: SGLang ``--dtype``, default the model's CPU default); prints the table, writes
    ``OUT/cases.jsonl`` (as rows finish) and ``OUT/results.json``, returns the summary. Ctrl-C
    stops the cases and reports what was measured. ``workers``: cases in flight at once (each
    case's paths stay in order, in its own namespaces; the server batches across cases).

    Raises:
        ValueError: ``n`` < 1, an unknown group.
    """
    from rich.console import Console
    from rich.progress import track

    from leyline_agent.chat.model_dir import load_renderer
    from leyline_agent.client import LeylineClient
    from leyline_agent.runinfo import environment

    if n < 1:
        raise ValueError(f"--n {n}: give at least one case per group")
    err = Console(stderr=True)
    renderer = load_renderer(model_dir)
    cases = list(nt.cases(renderer, n, seed, groups))
    err.print(f"{len(cases)} cases ({n} per group of {', '.join(groups)}, seed {seed})")
    server = None
    if backend is None:
        from leyline_agent.backends.sglang.launch import EmbeddedServer

        extra = ["--dtype", dtype] if dtype else []
        server = EmbeddedServer(model_path=model_dir, max_total_tokens=8192, extra_args=extra)
        backend = server.start().url
    rows: list[dict[str, Any]] = []
    out.mkdir(parents=True, exist_ok=True)
    info = {"url": backend, "started_here": server is not None, "dtype": dtype}
    t0 = time.perf_counter()
    try:
        with LeylineClient(backend) as client, (out / "cases.jsonl").open("w") as f:
            pool = ThreadPoolExecutor(max(workers, 1))
            try:
                done = pool.map(lambda c: run_case(client, renderer, c), cases)
                for row in track(done, total=len(cases), description="cases", console=err):
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                    f.flush()
            finally:
                pool.shutdown(wait=False, cancel_futures=True)
    except KeyboardInterrupt:
        err.print(f"stopped after {len(rows)} cases")
    finally:
        if server is not None:
            server.stop()
    summary = summarize(rows)
    summary["seconds_per_case"] = (time.perf_counter() - t0) / max(len(rows), 1)
    results = {
        "task": "nl", "n_per_group": n, "groups": list(groups), "seed": seed, "policy": nt.POLICY, "dtype": dtype,
        "new_tokens": NL_TOKENS, "model_dir": str(model_dir), "cases": len(rows),
        "summary": summary, "environment": environment(info),
    }  # fmt: skip
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(table({k: v for k, v in summary.items() if isinstance(v, dict)}))
    print(f"results: {out / 'results.json'}; cases: {out / 'cases.jsonl'}")
    return summary


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m leyline_agent.bench.fidelity.nl_run OUT/cases.jsonl")
    lines = Path(sys.argv[1]).read_text().splitlines()
    print(table(summarize([json.loads(x) for x in lines if x.strip()])))
