"""Data parallelism inside one server (SGLang ``--dp-size N``): which DP rank holds a session's KV,
and which worker's reply answers a control request.

SGLang runs one scheduler (own tree, own KV pool) per DP rank. A generate/chat request goes to one
rank (round robin unless ``routed_dp_rank`` names one); a control request such as the splice is
fanned out to every rank (``FanOutCommunicator``) and the HTTP side gets one reply per rank.

- Pinning: every request with a cache namespace (``extra_key`` or ``cache_salt`` set) is routed to
  ``home_rank(namespace, N)``, chosen by rendezvous hashing (``routing.py``) unless the client
  named a ``routed_dp_rank`` itself. A session's turns therefore always reach the rank that holds
  its KV, and so does its splice. Requests without a namespace keep SGLang's load balancing.
- The splice names its target rank (``SpliceReqInput.dp_rank``); every other worker answers
  ``NOT_MINE`` without touching its cache; ``pick_reply`` takes the target's reply.
- With no target (DP off), every worker runs the request and ``pick_reply`` applies the rule
  below, so a 409 from a rank that does not hold the sequence never hides the one that does.
- Pin ids name the DP rank that holds the pin (``pin_prefix``, ``rank_of_pin``), so an unpin by
  ``pin_id`` goes to that rank only.
- ``/leyline/stats`` with N > 1: ``merge_stats`` (sums, ``ok`` over all ranks, ``dp_workers``).

Pure Python (no sglang, no torch), unit-tested in ``tests/test_dp.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from leyline_agent.routing import home

#: The status of a worker that was not the target of a DP-pinned control request (never sent
#: to a client: ``pick_reply`` drops it).
NOT_MINE = 0


def namespace_key(extra_key: str | None, cache_salt: str | None) -> str | None:
    """The string a namespace is pinned by; None for the default namespace (not pinned)."""
    if extra_key is None and not cache_salt:
        return None
    return f"{extra_key or ''}\0{cache_salt or ''}"


def home_rank(extra_key: str | None, cache_salt: str | None, dp_size: int) -> int | None:
    """The DP rank that holds the namespace's KV; None when not pinned (no namespace, or
    ``dp_size`` <= 1)."""
    key = namespace_key(extra_key, cache_salt)
    if key is None or dp_size <= 1:
        return None
    return int(home([str(r) for r in range(dp_size)], key))


def pin_prefix(rank: int) -> str:
    """What the pin ids of DP rank ``rank`` start with (``p<rank>``; ``pins.py`` appends
    ``-<uuid>``), so an unpin by ``pin_id`` can be routed to the rank that holds the pin."""
    return f"p{rank}"


def rank_of_pin(pin_id: str) -> int | None:
    """The DP rank a ``pin_prefix`` pin id names; None when it names none."""
    rank = pin_id.partition("-")[0].removeprefix("p")
    return int(rank) if rank.isdigit() else None


class Reply(NamedTuple):
    """One worker's answer: its DP rank, HTTP status and JSON body."""

    dp_rank: int
    status: int
    body: str


def pick_reply(replies: Sequence[Reply], target: int | None) -> Reply:
    """The reply that answers the client.

    ``target`` set: that rank's reply (the others answered ``NOT_MINE``). No target: the replies of
    the ranks that held the sequence (status other than 409); none -> the lowest rank's 409; else
    an error (non-200) if any rank failed (its cache misses the edit), else the lowest rank's 200.

    Raises:
        ValueError: no reply, or none from ``target``.
    """
    if not replies:
        raise ValueError("no reply from any DP worker")
    ordered = sorted(replies, key=lambda r: r.dp_rank)
    if target is not None:
        for r in ordered:
            if r.dp_rank == target:
                return r
        raise ValueError(f"no reply from DP rank {target}")
    held = [r for r in ordered if r.status not in (409, NOT_MINE)]
    if not held:
        return next((r for r in ordered if r.status != NOT_MINE), ordered[0])
    return next((r for r in held if r.status != 200), held[0])


_SUMMED = (
    "free", "cached", "in_use", "total", "evictable", "protected",
    "duplicate_slots", "tree_and_free_list", "pins", "pinned_slots",
)  # fmt: skip
_ALL = ("idle", "sglang_idle_check")


def merge_stats(per_worker: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``/leyline/stats`` over DP workers (rank order): one worker's stats unchanged; several:
    counters summed, ``idle``/``sglang_idle_check`` true when true on every rank, ``busy`` the
    union of the ranks' busy states, ``ok`` False if
    any rank is False, else None if any is None, else True; each rank's own under ``dp_workers``."""
    if len(per_worker) == 1:
        return dict(per_worker[0])
    out: dict[str, Any] = {}
    for k in _SUMMED:
        vals = [w[k] for w in per_worker if isinstance(w.get(k), int)]
        if vals:
            out[k] = sum(vals)
    for k in _ALL:
        if any(k in w for w in per_worker):
            out[k] = all(bool(w.get(k)) for w in per_worker)
    if any("busy" in w for w in per_worker):  # the busy states of any rank (busy.py)
        out["busy"] = sorted({b for w in per_worker for b in w.get("busy") or []})
    oks = [w.get("ok") for w in per_worker]
    if any("ok" in w for w in per_worker):
        out["ok"] = False if False in oks else (None if None in oks else True)
    errors = [w["error"] for w in per_worker if "error" in w]
    if errors:
        out["error"] = errors[0]
    out["dp_size"] = len(per_worker)
    out["dp_workers"] = [dict(w) for w in per_worker]
    return out
