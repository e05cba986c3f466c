"""What a session keeps beyond its turns: its one pin (``SessionPins``) and forks (``fork``).

- **Pin**: ``POST /leyline/pin`` keeps a held prefix resident for a TTL, in the session's request
  namespace, owned by its own namespace (so ``release`` frees every pin of the session). A session
  keeps one pin: a new one is made first, then the previous one released (``replaced``).
- **Fork**: a new session starts from another one's state. A private parent's held tokens are
  copied into the child's own namespace (``POST /leyline/fork``; the child is private from then
  on, so its splices never touch the parent's KV); a shared parent's are already in the shared
  namespace, which the child then uses too.

Pure Python (the backend through ``LeylineClient``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from leyline_agent.client import PinRejected
from leyline_agent.markers import DEFAULT_TTL_S, Marker, marked_end
from leyline_agent.placement import Placement
from leyline_agent.wire import ForkResponse, PinResponse

if TYPE_CHECKING:
    from leyline_agent.session import SessionCore
    from leyline_agent.wrapper import TurnPlan


class SessionPins:
    """One session's pin on its backend (module docstring)."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        self.pinned: PinResponse | None = None  # the session's one pin
        self.replaced = 0  # previous pins ``pin`` released (not those expired first)

    def pin(self, tokens: Sequence[int], *, ttl_s: float = DEFAULT_TTL_S) -> PinResponse:
        """Keep ``tokens`` (a held prefix) resident for ``ttl_s`` seconds.

        Raises:
            PinRejected: the backend refused (409 not cached, 422 TTL out of range, 429 the
                server's cap on pinned slots); the previous pin stays. Or the new pin was made
                (``pinned`` is it) and releasing the previous one failed: it expires with its
                TTL.
            ValueError: ``tokens`` is empty.
        """
        if not tokens:
            raise ValueError("nothing held to pin")
        where = self.placement
        new = where.client.pin(
            list(tokens), ttl_s=ttl_s, extra_key=where.extra_key, cache_salt=where.salt,
            owner=where.own,
        )  # fmt: skip
        old, self.pinned = self.pinned, new
        if old is not None and old.pin_id != new.pin_id:
            try:
                self.replaced += where.client.unpin(old.pin_id)
            except PinRejected as e:
                if e.status != 404:  # 404: it expired already
                    raise
        return new

    def pin_marked(self, held: Sequence[int], plan: TurnPlan, marker: Marker) -> PinResponse | None:
        """After a turn: pin the prompt up to the end of the marked message (``marker``: indices
        of the turn's messages) for its TTL; None when the session does not hold it as planned
        (``held``: a resync, a failed request) or the policy dropped everything up to it.
        Raises as ``pin``."""
        end = marked_end(plan.spans, plan.sources, marker.message)
        if end == 0 or list(held[:end]) != plan.tokens[:end]:
            return None
        return self.pin(held[:end], ttl_s=marker.ttl_s)

    def release(self) -> int:
        """Release every pin of the session (owner: its own namespace); the number released.
        Raises ``PinRejected``."""
        self.pinned = None
        return self.placement.client.unpin(owner=self.placement.own)

    def forget(self) -> None:
        """The pin stays on a backend the session left (until its TTL)."""
        self.pinned = None


def fork(child: SessionCore, parent: SessionCore) -> ForkResponse | None:
    """Start ``child`` (a new session) from ``parent``'s state (idle); the fork's answer when the
    parent's KV was copied, None when it is shared. Nothing is adopted when the copy is refused.

    Raises:
        ForkRejected: the backend refused the copy (e.g. 409: the parent's KV was evicted).
        ValueError: ``parent`` is ``child``, or lives in another shared namespace.
    """
    mine, theirs = child.placement, parent.placement
    if parent is child or theirs.own == mine.own:
        raise ValueError("a session cannot fork from itself")
    if mine.share_exact and theirs.shared != mine.shared:
        raise ValueError("the parent's exact KV is in another shared namespace")
    held = parent.wrapper.tokens
    copied: ForkResponse | None = None
    if held and (theirs.private or not mine.share_exact):
        copied = mine.client.fork(
            list(held), extra_key=theirs.extra_key, target_extra_key=mine.own,
            cache_salt=theirs.salt,
        )  # fmt: skip
    child.adopt(parent, copied=copied is not None)
    return copied
