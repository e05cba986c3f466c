"""When the scheduler is busy: the states SGLang itself treats as not idle, by name.

``/leyline/stats`` (``integrity.stats``) holds an idle server to ``free + cached == total``; in any
of these states a request owns slots outside the tree (or is about to), so the verdict must wait.
SGLang 0.5.23's own answer is ``Scheduler.is_fully_idle()`` (``managers/scheduler.py``: the gate of
its idle leak check, ``scheduler_components/invariant_checker.py``); the stats handler runs
between batches, where it sees states a request passes through mid-flight:

- ``running_batch``: decoding requests;
- ``waiting_queue``: queued, and retracted requests (put back there);
- ``chunked_req``: a chunked prefill between two chunks (in neither batch; owns its row);
- ``last_batch``: the batch just run, a new request's prefill not yet merged into the running
  batch (its slots held by the request);
- ``result_queue``: the overlap schedule's batch in flight (``enable_overlap``);
- ``grammar_queue``: a request waiting on its grammar's compilation;
- ``disagg_*``: prefill/decode disaggregation's bootstrap, in-flight, prealloc (and retracted),
  transfer queues and deferred releases;
- ``hicache``: HiCache's write-through, load-back, prefetch and backup operations;
- ``sglang``: ``is_fully_idle()`` says busy for a reason not named above (dLLM staging, pipeline
  micro-batches, HiSparse, LMCache, a newer SGLang).
"""

from __future__ import annotations

from typing import Any


def _size(x: Any) -> int:
    if x is None:
        return 0
    queue = getattr(x, "queue", x)
    try:
        return len(queue)
    except TypeError:
        return 0


def _nonempty_batch(batch: Any) -> bool:
    return batch is not None and not batch.is_empty()


def busy_states(scheduler: Any) -> list[str]:
    """The names (module doc) of the busy states ``scheduler`` is in; ``[]`` when idle.

    Reads the scheduler's attributes (``compat.ATTRIBUTES['Scheduler']``), each when present, and
    ``is_fully_idle()`` when the scheduler has it. Never raises for a missing attribute.
    """
    s = scheduler
    out = []
    if _nonempty_batch(getattr(s, "running_batch", None)):
        out.append("running_batch")
    if _size(getattr(s, "waiting_queue", None)):
        out.append("waiting_queue")
    if getattr(s, "chunked_req", None) is not None:
        out.append("chunked_req")
    if _nonempty_batch(getattr(s, "last_batch", None)):
        out.append("last_batch")
    if getattr(s, "enable_overlap", False) and _size(getattr(s, "result_queue", None)):
        out.append("result_queue")
    if _size(getattr(getattr(s, "grammar_manager", None), "grammar_queue", None)):
        out.append("grammar_queue")
    for name in (
        "disagg_prefill_bootstrap_queue",
        "disagg_prefill_inflight_queue",
        "disagg_decode_prealloc_queue",
        "disagg_decode_transfer_queue",
    ):
        q = getattr(s, name, None)
        if _size(q) or _size(getattr(q, "retracted_queue", None)):
            out.append(name.replace("_queue", ""))
        pending = getattr(q, "has_pending_deferred_releases", None)
        if callable(pending) and pending():
            out.append(f"{name.replace('_queue', '')}_deferred")
    if getattr(s, "enable_hierarchical_cache", False):
        tc = s.tree_cache
        ops = ("ongoing_write_through", "ongoing_load_back", "ongoing_prefetch", "ongoing_backup")
        if any(_size(getattr(tc, op, None)) for op in ops):
            out.append("hicache")
    fully_idle = getattr(s, "is_fully_idle", None)
    if callable(fully_idle) and not out:
        try:
            if not fully_idle():
                out.append("sglang")
        except Exception:  # a state this SGLang cannot evaluate here: not a verdict of busy
            pass
    return out
