"""``leyline bench splice``: a splice plus the next request vs re-prefilling the edited sequence.

Per length ``L`` and repeat, in a fresh namespace (``extra_key``) each:

1. setup (not timed): ``/generate`` with ``L`` random token ids, one output token, so the radix
   tree holds the sequence;
2. (a) ``POST /leyline/splice`` with one AMORTIZE directive near the start (default: replace
   ``[16, 48)`` with 8 tokens), then ``/generate`` with the edited sequence plus a few new tokens;
   the request should find the whole edited sequence cached;
3. (b) ``/generate`` with the same request in another fresh namespace: a cold prefill of
   everything, what an engine without an edit channel does after an edit near the start.

Times are client-side wall times in milliseconds (HTTP included), medians over the repeats. The
splice breakdown (``prefill``, ``rotate``, ``tree``) is the server's ``timings_ms`` when it reports
one. Memory is the server processes' resident set read from ``/proc`` when this process started
the server (Linux only), otherwise the KV-pool counters of ``/leyline/stats``.

Pure Python (httpx, rich; matplotlib for the plot); the backend is any ``leyline serve``.

- ``measure.py``: `SpliceBenchSpec`, `Trial`, `run_trial`, `run`;
- ``memory.py``: the memory probes (`ProcMemory`, `StatsMemory`) and `process_memory`;
- ``report.py``: `summarize`, `table`, `plot`, `write_results`.
"""

from leyline_agent.bench.splice.measure import (
    DEFAULT_LENGTHS,
    SpliceBenchSpec,
    Trial,
    run,
    run_trial,
    splice_raw,
)
from leyline_agent.bench.splice.memory import (
    MEMORY_NOTE,
    MemoryProbe,
    NoMemory,
    ProcMemory,
    StatsMemory,
    process_memory,
)
from leyline_agent.bench.splice.report import plot, summarize, table, write_results

__all__ = [
    "DEFAULT_LENGTHS",
    "MEMORY_NOTE",
    "MemoryProbe",
    "NoMemory",
    "ProcMemory",
    "SpliceBenchSpec",
    "StatsMemory",
    "Trial",
    "plot",
    "process_memory",
    "run",
    "run_trial",
    "splice_raw",
    "summarize",
    "table",
    "write_results",
]
