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


def best_match(
    candidates: Sequence[ProxySession],
    messages: Sequence[Mapping[str, Any]],
    min_shared: float = MIN_SHARED,
) -> ProxySession | None:
    """The session of ``candidates`` (anonymous, same tenant and salt, no turn in flight) that
    the request ``messages`` continues, if any.

    A candidate qualifies only when its committed history is *shorter* than the request (a
    session that has already reached this request's length took an equal request before: the
    request is another run of the same agent, never merged into it). The candidate sharing the
    longest leading run of messages (measured in characters) wins, an exact prefix before an
    edited history; an edited history (the agent rewrote an earlier message) qualifies only when
    the shared part is at least ``min_shared`` of the session's history. A tie means identical
    histories (two runs of one agent in lockstep): it goes to the least recently used, so runs
    that alternate turns keep their own sessions.
    """
    incoming: list[dict[str, Any]] | None = None
    best: tuple[tuple[int, bool, float], ProxySession] | None = None
    for s in candidates:
        if not 0 < len(s.core.messages) < len(messages):
            continue
        if incoming is None:
            incoming = [match_form(m) for m in messages]
        forms, sizes = s.committed_form()
        n = shared(forms, incoming)
        if n == 0:
            continue
        exact = n == len(forms)
        if not exact and sizes[n - 1] < min_shared * sizes[-1]:
            continue
        rank = (sizes[n - 1], exact, -s.last_used)
        if best is None or rank > best[0]:
            best = (rank, s)
    return None if best is None else best[1]
