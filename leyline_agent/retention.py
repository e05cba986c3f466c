"""What a session keeps beyond its turns: its pins (``SessionPins``) and forks (``fork``).

- **Pins**: ``POST /leyline/pin`` keeps a held prefix resident for a TTL, in the session's request
  namespace, owned by its own namespace (so ``release`` frees every pin of the session). A session
  keeps one pin per breakpoint (``markers.cache_markers``), keyed by the prefix it covers (its
  length, the breakpoint's end in the prompt), each with its own TTL: a 1-hour system prompt stays
  pinned for its hour while the 5-minute marker on the last message moves on. After a marked turn
  (``pin_marked``) every breakpoint is pinned again: a new pin first, then the previous pin of the
  same prefix released (a renewal: the TTL starts again, as Anthropic refreshes a cache entry on
  use). A pin of a prefix the turn no longer marks is then released when it is of no use (counted
  in ``replaced`` too): its prefix is not the session's any more (an edit before its end: it only
  holds room under the server's cap and makes splices over it copy), or a pin made by this turn
  covers it for at least as long (a moved marker: nothing is lost). Otherwise it is left to expire
  with its TTL, as Anthropic keeps a cache entry for its TTL whether or not later requests mark it
  (a 1-hour system prompt marked once, then only the last message marked for 5 minutes, stays
  pinned for its hour). A pin past its ``expires_at`` is not ``live`` any more (the server
  released it) and is forgotten by the next marked turn.
- **Fork**: a new session starts from another one's state. A private parent's held tokens are
  copied into the child's own namespace (``POST /leyline/fork``; the child is private from then
  on, so its splices never touch the parent's KV); a shared parent's are already in the shared
  namespace, which the child then uses too.

Pure Python (the backend through ``LeylineClient``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, NamedTuple

from leyline_agent.client import PinRejected
from leyline_agent.markers import DEFAULT_TTL_S, TOOLS, Marker, marked_end, tools_end
from leyline_agent.placement import Placement
from leyline_agent.wire import ForkResponse, PinResponse

if TYPE_CHECKING:
    from leyline_agent.session import SessionCore
    from leyline_agent.wrapper import TurnPlan


class PinOutcome(NamedTuple):
    """What ``SessionPins.pin_marked`` did: the pins made (one per breakpoint pinned, new or
    renewed, by prefix length), the previous pins released (renewed, or no longer marked), the
    refusals of pins not made (that breakpoint's previous pin, if any, stays until its TTL), and
    the failed releases of replaced pins (those expire with their TTL)."""

    made: list[PinResponse]
    replaced: int
    refused: list[PinRejected]
    stale: list[PinRejected]


class SessionPins:
    """One session's pins on its backend, one per breakpoint (module docstring).

    Args:
        placement: where the session's requests go (client, namespaces, salt).
        clock: Unix time, to tell the pins past their ``expires_at`` (the server's clock).
    """

    def __init__(self, placement: Placement, clock: Callable[[], float] = time.time) -> None:
        self.placement = placement
        self.clock = clock
        # by the length of the prefix pinned; NOTE: replaced, never changed in place, so that a
        # reader (the proxy's session record, on the event loop) never sees it change under it
        # while a turn's pins are made in a worker thread
        self.pins: dict[int, PinResponse] = {}
        self._held: dict[str, int] = {}  # pin id -> digest of the tokens it pins (``_digest``)
        self.replaced = 0  # previous pins released (renewed, or no longer marked); not expired ones

    def live(self) -> list[PinResponse]:
        """The session's pins not expired yet, by prefix length (read only: the expired ones
        are forgotten by the next ``pin_marked``)."""
        now, pins = self.clock(), self.pins
        return [pins[end] for end in sorted(pins) if pins[end].expires_at > now]

    @property
    def pinned(self) -> PinResponse | None:
        """The live pin of the longest prefix (the last breakpoint's); None: none."""
        live = self.live()
        return live[-1] if live else None

    def _unpin(self, old: PinResponse) -> None:
        """Release ``old`` (counted in ``replaced``); one that expired already is no error."""
        self._held.pop(old.pin_id, None)
        try:
            self.replaced += self.placement.client.unpin(old.pin_id)
        except PinRejected as e:
            if e.status != 404:  # 404: it expired already
                raise

    def _renew(self, tokens: Sequence[int], ttl_s: float) -> tuple[PinResponse, PinRejected | None]:
        """Pin ``tokens`` (the pin of that prefix length from now on), then release the previous
        pin of the same length; the new pin and the release's failure, if it failed. Raises
        ``PinRejected`` when the pin is refused (nothing changed)."""
        where = self.placement
        new = where.client.pin(
            list(tokens), ttl_s=ttl_s, extra_key=where.extra_key, cache_salt=where.salt,
            owner=where.own,
        )  # fmt: skip
        old = self.pins.get(len(tokens))
        self.pins = {**self.pins, len(tokens): new}
        self._held[new.pin_id] = _digest(tokens)
        if old is not None and old.pin_id != new.pin_id:
            try:
                self._unpin(old)
            except PinRejected as e:
                return new, e
        return new, None

    def pin(self, tokens: Sequence[int], *, ttl_s: float = DEFAULT_TTL_S) -> PinResponse:
        """Keep ``tokens`` (a held prefix) resident for ``ttl_s`` seconds: the session's pin of
        that prefix, made new (a previous pin of the same prefix is released after it, counted in
        ``replaced``); the session's pins of other prefixes stay.

        Raises:
            PinRejected: the backend refused (409 not cached, 422 TTL out of range, 429 the
                server's cap on pinned slots); the previous pin stays. Or the new pin was made
                (it is in ``pins``) and releasing the previous one failed: it expires with its
                TTL.
            ValueError: ``tokens`` is empty.
        """
        if not tokens:
            raise ValueError("nothing held to pin")
        new, failed = self._renew(tokens, ttl_s)
        if failed is not None:
            raise failed
        return new

    def breakpoints(
        self,
        held: Sequence[int],
        plan: TurnPlan,
        markers: Sequence[Marker],
        decode: Callable[[Sequence[int]], str],
    ) -> dict[int, float]:
        """The prefixes a turn's ``markers`` (indices of its messages, or ``TOOLS``) ask to pin:
        ``{end: ttl_s}`` (the longest TTL where two breakpoints end at the same token). A
        message's end is ``markers.marked_end``, the tools' ``markers.tools_end`` (``decode``:
        the renderer's). Left out: an end of 0 (the policy dropped everything up to it, no tool
        rendered) or one the session does not hold as planned (``held``: a resync, a failed
        request)."""
        wanted: dict[int, float] = {}
        for m in markers:
            if m.message == TOOLS:
                end = tools_end(plan.tokens, plan.spans, plan.tools, decode)
            else:
                end = marked_end(plan.spans, plan.sources, m.message)
            if end == 0 or list(held[:end]) != plan.tokens[:end]:
                continue
            wanted[end] = max(wanted.get(end, 0.0), m.ttl_s)
        return wanted

    def pin_marked(
        self,
        held: Sequence[int],
        plan: TurnPlan,
        markers: Sequence[Marker],
        decode: Callable[[Sequence[int]], str],
    ) -> PinOutcome:
        """After a turn: pin every breakpoint (``breakpoints``) for its own TTL, renewing the
        session's pin of the same prefix; then, when every one was pinned, release the session's
        pins of prefixes no longer marked that are of no use (``_of_no_use``; the others, and
        all of them when a pin was refused, stay until their TTL, as the refused breakpoint's
        previous pin does). Refusals are returned, never raised."""
        wanted = self.breakpoints(held, plan, markers, decode)
        now = self.clock()  # the expired ones forgotten (the server released them)
        self.pins = {end: p for end, p in self.pins.items() if p.expires_at > now}
        self._held = {p.pin_id: self._held[p.pin_id] for p in self.pins.values()
                      if p.pin_id in self._held}  # fmt: skip
        before = self.replaced
        made: list[PinResponse] = []
        refused: list[PinRejected] = []
        stale: list[PinRejected] = []
        for end, ttl_s in sorted(wanted.items()):
            try:
                new, failed = self._renew(held[:end], ttl_s)
            except PinRejected as e:
                refused.append(e)
                continue
            made.append(new)
            if failed is not None:
                stale.append(failed)
        if wanted and not refused:
            for end in sorted(set(self.pins) - set(wanted)):
                old = self.pins[end]
                if not self._of_no_use(old, end, held, made):
                    continue  # NOTE: left to expire with its TTL
                self.pins = {k: p for k, p in self.pins.items() if k != end}
                try:
                    self._unpin(old)
                except PinRejected as e:
                    stale.append(e)
        return PinOutcome(made, self.replaced - before, refused, stale)

    def _of_no_use(
        self, old: PinResponse, end: int, held: Sequence[int], made: Collection[PinResponse]
    ) -> bool:
        """Whether a pin the turn no longer marks may go (module docstring): the session no
        longer holds its prefix, or a pin made by this turn covers it at least as long."""
        if len(held) < end or self._held.get(old.pin_id) != _digest(held[:end]):
            return True
        return any(p.pinned_tokens >= end and p.expires_at >= old.expires_at for p in made)

    def release(self) -> int:
        """Release every pin of the session (owner: its own namespace); the number released.
        Raises ``PinRejected``."""
        self.pins, self._held = {}, {}
        return self.placement.client.unpin(owner=self.placement.own)

    def forget(self) -> None:
        """The pins stay on a backend the session left (until their TTL)."""
        self.pins, self._held = {}, {}


def _digest(tokens: Sequence[int]) -> int:
    """What tells a pinned prefix from another of the same length (within this process)."""
    return hash(tuple(tokens))


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
