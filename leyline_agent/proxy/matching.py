"""Which live anonymous session an unnamed request continues (``SessionRegistry``'s step 3).

Messages are compared in their ``identity.match_form`` (without cache markers, text parts
joined); sizes are characters of canonical JSON, a stand-in for rendered tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from leyline_agent.proxy.identity import match_form, shared

if TYPE_CHECKING:
    from leyline_agent.proxy.sessions import ProxySession

# NOTE: an anonymous request may continue a session whose history it does not extend exactly
# (the agent edited it) when the shared prefix is at least this share of the session's history.
MIN_SHARED = 0.5


def window(forms: Sequence[Any], incoming: Sequence[Any], n: int) -> int | None:
    """Where the session's kept messages start when ``incoming`` is its history with messages
    ``forms[n:j]`` dropped after the ``n`` shared leading ones (a sliding window: an agent that
    drops its oldest turns, keeping its system prompt) and at least one new message after the
    kept ones: the smallest such ``j`` (None: no window)."""
    if n >= len(incoming):
        return None
    for j in range(n + 1, len(forms)):
        kept = len(forms) - j
        if n + kept < len(incoming) and forms[j] == incoming[n]:
            if all(forms[j + i] == incoming[n + i] for i in range(1, kept)):
                return j
    return None


def best_match(
    candidates: Sequence[ProxySession],
    messages: Sequence[Mapping[str, Any]],
    min_shared: float = MIN_SHARED,
    *,
    repeat: bool = False,
) -> ProxySession | None:
    """The session of ``candidates`` (same tenant, scope and salt, no turn in flight) that the
    request ``messages`` continues, if any.

    A candidate qualifies when its committed history is *shorter* than the request (a session
    that has already reached this request's length took an equal request before: the request is
    another run of the same agent, never merged into it), or when the request is its history as
    a sliding window (``window``: oldest messages dropped after the shared leading ones, at least
    one new message after the kept ones; any length). The candidate sharing the most (measured
    in characters: the leading run, plus the kept run of a window) wins, an exact prefix before
    an edited history; an edited history (the agent rewrote or dropped an earlier message)
    qualifies only when the shared part is at least ``min_shared`` of the session's history. A
    tie means identical histories (two runs of one agent in lockstep): it goes to the least
    recently used, so runs that alternate turns keep their own sessions. ``repeat`` (a user's
    scope: one person, not parallel runs of an agent): a request equal to a session's history
    (a chat front end's "regenerate") continues it too.
    """
    incoming: list[dict[str, Any]] | None = None
    best: tuple[tuple[int, bool, float], ProxySession] | None = None
    for s in candidates:
        if not s.core.messages:
            continue
        if incoming is None:
            incoming = [match_form(m) for m in messages]
        forms, sizes = s.committed_form()
        n = shared(forms, incoming)
        exact = n == len(forms)
        common = sizes[n - 1] if n else 0
        j = None if exact else window(forms, incoming, n)
        if j is not None:
            common += sizes[-1] - sizes[j - 1]
        elif n == 0 or len(forms) > len(incoming):
            continue
        elif len(forms) == len(incoming) and not (repeat and exact):
            continue
        if not exact and common < min_shared * sizes[-1]:
            continue
        rank = (common, exact, -s.last_used)
        if best is None or rank > best[0]:
            best = (rank, s)
    return None if best is None else best[1]
