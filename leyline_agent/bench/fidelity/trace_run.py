"""``leyline bench fidelity --model NAME``: the trace cases of ``traces.py`` run on a served real
model, with a progress bar; prints the table and writes ``OUT/results.json`` and
``OUT/cases.jsonl``."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from leyline_agent.bench.fidelity import traces as tf


def run_traces(
    model_dir: Path,
    trace_paths: list[Path],
    out: Path,
    *,
    n: int,
    budget: int,
    backend: str | None = None,
) -> dict[str, Any]:
    """Build the cases from ``trace_paths`` (at most ``n``, each turn fitted to ``budget``
    tokens), run them on ``backend`` (default: a ``leyline serve`` of ``model_dir`` started
    here), and return the summary (``traces.summarize``).

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
    spec = replace(tf.TraceFidelitySpec(), n=n, budget=budget)
    renderer = load_renderer(model_dir)
    loaded = [t for p in trace_paths for t in load(p) if t.turns]
    cases = list(tf.cases(loaded, renderer, spec))
    if not cases:
        raise ValueError(f"no edited turn in {', '.join(map(str, trace_paths))}")
    err.print(f"{len(cases)} edited turns from {len(loaded)} traces (budget {budget} tokens)")
    server = None
    if backend is None:
        from leyline_agent.backends.sglang.launch import EmbeddedServer

        pool = 4 * (budget + 64) + 4096
        server = EmbeddedServer(model_path=model_dir, max_total_tokens=pool).start()
        backend = server.url
    rows = []
    t0 = time.perf_counter()
    try:
        with LeylineClient(backend) as client:
            info = {"url": backend, "started_here": server is not None}
            for case in track(cases, description="cases", console=err):
                rows.append(tf.run_case(client, case, spec))
    finally:
        if server is not None:
            server.stop()
    summary = tf.summarize(rows)
    summary["seconds_per_case"] = (time.perf_counter() - t0) / len(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cases.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = {
        "spec": tf.spec_dict(spec),
        "model_dir": str(model_dir),
        "traces": [str(p) for p in trace_paths],
        "summary": summary,
        "environment": environment(info),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(tf.table(summary))
    print(f"results: {out / 'results.json'}; cases: {out / 'cases.jsonl'}")
    return summary
