"""``leyline bench fidelity --model NAME``: the trace cases of ``traces.py`` run on a served real
model, with a progress bar; prints the table and writes ``OUT/results.json`` and
``OUT/cases.jsonl``."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from leyline_agent.bench.fidelity import composed as cp
from leyline_agent.bench.fidelity import traces as tf


def run_traces(
    model_dir: Path,
    trace_paths: list[Path],
    out: Path,
    *,
    n: int,
    budget: int,
    caps: list[int] | None = None,
    backend: str | None = None,
    dtype: str | None = None,
    rerun: Path | None = None,
    composed: int = 0,
    policies: list[str] | None = None,
) -> dict[str, Any]:
    """Build the cases from ``trace_paths`` (each turn fitted to ``budget`` tokens; one set of
    cases per message cap in ``caps``, characters, default ``[1200]``; at most ``n`` in all),
    run them on ``backend`` (default: a ``leyline serve`` of ``model_dir`` started here, in
    ``dtype``: SGLang ``--dtype``, default the model's CPU default), and return the summary
    (``traces.summarize``). ``rerun``: a ``cases.jsonl`` of an earlier run; only its cases
    (trace, turn, policy, cap) are run again. ``composed``: also run that many composed-splice
    sessions (``composed.py``; on the first distinct fitted turns; ``n`` = 0: only those), rows
    in ``OUT/composed.jsonl``. ``policies``: the edits (default ``TraceFidelitySpec.policies``);
    the cases take each (cap, policy) group in turn (``traces.interleave``), so the first ``n``
    hold as many of each as there are. Rows are appended to ``OUT/cases.jsonl`` as they
    finish, so an interrupted run keeps what it measured.

    Raises:
        ValueError: no trace path, or no edited turn in them.
    """
    from rich.console import Console
    from rich.progress import track

    from leyline_agent.chat.model_dir import load_renderer
    from leyline_agent.client import LeylineClient
    from leyline_agent.runinfo import environment
    from leyline_agent.traces import load

    if not trace_paths:
        raise ValueError("--traces: give at least one trace file or directory")
    err = Console(stderr=True)
    caps = caps or [tf.TraceFidelitySpec().cap_chars]
    spec = replace(tf.TraceFidelitySpec(), n=n, budget=budget)
    renderer = load_renderer(model_dir)
    loaded = [t for p in trace_paths for t in load(p) if t.turns]
    spec = replace(spec, policies=tuple(policies) if policies else spec.policies)
    groups = [
        list(tf.cases(loaded, renderer, replace(spec, cap_chars=cap, policies=(p,), n=10**9)))
        for cap in caps
        for p in spec.policies
    ]
    cases = tf.interleave(groups)
    if rerun is not None:
        rows0 = [json.loads(line) for line in rerun.read_text().splitlines() if line.strip()]
        keys = {(r["trace"], r["turn"], r["policy"], r.get("cap", 1200)) for r in rows0}
        cases = [c for c in cases if (c.trace, c.turn, c.policy, c.cap) in keys]
    turns: dict[tuple[str, int, int], tf.Case] = {}
    for c in cases:
        turns.setdefault((c.trace, c.turn, c.cap), c)
    sessions = list(turns.values())[:composed]
    cases = cases[:n]
    if not cases and not sessions:
        raise ValueError(f"no edited turn in {', '.join(map(str, trace_paths))}")
    err.print(
        f"{len(cases)} edited turns from {len(loaded)} traces (budget {budget} tokens, "
        f"message caps {caps} characters)"
    )
    server = None
    if backend is None:
        from leyline_agent.backends.sglang.launch import EmbeddedServer

        pool = 4 * (budget + 64) + 4096
        extra = ["--dtype", dtype] if dtype else []
        server = EmbeddedServer(
            model_path=model_dir, max_total_tokens=pool, extra_args=extra
        ).start()
        backend = server.url
    rows: list[dict[str, Any]] = []
    crows: list[dict[str, Any]] = []
    out.mkdir(parents=True, exist_ok=True)
    (out / "cases.jsonl").write_text("")
    t0 = time.perf_counter()
    try:
        with LeylineClient(backend) as client, (out / "cases.jsonl").open("a") as f:
            info = {"url": backend, "started_here": server is not None, "dtype": dtype}
            for case in track(cases, description="cases", console=err):
                rows.append(tf.run_case(client, case, spec))
                f.write(json.dumps(rows[-1]) + "\n")
                f.flush()
            t1 = time.perf_counter()
            filler = list(renderer.encode(" …"))[-1]
            with (out / "composed.jsonl").open("w") as g:
                for case in track(sessions, description="composed", console=err):
                    for r in cp.run_session(client, case, spec, filler):
                        crows.append(r)
                        g.write(json.dumps(r) + "\n")
                        g.flush()
    finally:
        if server is not None:
            server.stop()
    summary = tf.summarize(rows) if rows else {}
    if rows:
        summary["seconds_per_case"] = (t1 - t0) / len(rows)
    if crows:
        summary["composed"] = cp.summarize(crows)
        summary["composed"]["seconds_per_session"] = (time.perf_counter() - t1) / len(sessions)
    results = {
        "spec": {**tf.spec_dict(spec), "cap_chars": caps},
        "dtype": dtype,
        "model_dir": str(model_dir),
        "traces": [str(p) for p in trace_paths],
        "summary": summary,
        "environment": environment(info),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    if rows:
        print(tf.table(summary))
        print(tf.policy_table(rows))
    if crows:
        print(cp.table({k: v for k, v in summary["composed"].items() if k.isdigit()}))
    print(f"results: {out / 'results.json'}; cases: {out / 'cases.jsonl'}")
    return summary
