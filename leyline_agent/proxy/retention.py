"""Pins and forks in the proxy: ``cache_control`` markers become pins, ``X-Leyline-Fork-From``
starts a session from another one, and an ended session's pins are released.

- **Pin** (``pin_turn``): after a turn whose messages or tools carry ephemeral ``cache_control``
  markers (``markers.cache_markers``, at most 4), the prompt up to each breakpoint (the end of a
  marked message, or of the tools) is pinned on the session's backend for that marker's own TTL
  (300 s by default); one pin per breakpoint, renewed every turn that marks it again (the new one
  first, then the old one released: ``pins_replaced``), and a pin of a prefix the turn no longer
  marks released when of no use (edited, or covered as long by a new pin: ``pins_replaced`` too),
  else left to its TTL (see ``leyline_agent.retention``). A refusal, the server's cap on pinned
  slots (429) included, is logged, counted and shown in the session's record
  (``ProxySession.pin_error``), never an error of the client's request. So is a marker's TTL
  that was not taken as sent (``markers.parse_ttl``): clamped to 24 h, or malformed and the
  default.
- **Fork** (``fork_session``): a new session's first request naming a parent starts from the
  parent's history (``leyline_agent.retention.fork``); it is routed to the parent's backend, where a private
  parent's KV is copied into its namespace (``POST /leyline/fork``). A refused fork (the parent's
  KV evicted) leaves the child cold, counted in ``fork_misses``.
- **Release** (``release_session``): a session dropped by the registry or ended by
  ``DELETE /leyline/sessions/{id}`` releases its pins (``/leyline/unpin`` by owner: its
  namespace), and so does every live session when the proxy shuts down (``release_all``: nothing
  could renew or release them after it, and a 1-hour pin would hold its room under the server's
  cap for its hour); otherwise they expire with their TTL.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio.to_thread

from leyline_agent.client import ForkRejected, PinRejected
from leyline_agent.markers import Marker
from leyline_agent.proxy.sessions import PinError, ProxySession
from leyline_agent.retention import fork
from leyline_agent.session import Pending

log = logging.getLogger(__name__)


@dataclass
class RetentionCounters:
    """Pins and forks over every session the proxy served (``/metrics``)."""

    pins: int = 0  # pins made, one per breakpoint pinned (each renewal counts)
    pins_refused: int = 0  # refused by the server's cap (429)
    pin_errors: int = 0  # refused otherwise (409 not cached, unreachable, ...)
    pins_replaced: int = 0  # previous pins released by a later marked turn (renewed, unmarked)
    pins_released: int = 0  # released by /leyline/unpin when a session ended
    pin_ttl_clamped: int = 0  # markers whose ttl was above 24 h (pinned for 24 h)
    pin_ttl_invalid: int = 0  # markers whose ttl was malformed or not positive (the default)
    forks: int = 0  # sessions started from another one
    fork_copies: int = 0  # ... whose parent's KV was copied (a private parent)
    fork_misses: int = 0  # ... whose copy was refused (the child started cold)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, **deltas: int) -> None:
        with self.lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)


class Retention:
    """The proxy's pins and forks (module docstring)."""

    def __init__(self) -> None:
        self.counters = RetentionCounters()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def pin_turn(
        self, session: ProxySession, pending: Pending, markers: Sequence[Marker]
    ) -> None:
        """Pin the breakpoints of the turn just finished (see ``SessionPins.pin_marked``)."""
        for marker in markers:
            self.check_ttl(session, marker)
        core = session.core
        outcome = await anyio.to_thread.run_sync(
            core.pins.pin_marked, core.wrapper.tokens, pending.plan, markers,
            core.wrapper.renderer.decode,
        )  # fmt: skip
        refused = sum(e.status == 429 for e in outcome.refused)
        self.counters.count(
            pins=len(outcome.made), pins_replaced=outcome.replaced, pins_refused=refused,
            pin_errors=len(outcome.refused) - refused,
        )  # fmt: skip
        for e in outcome.stale:  # NOTE: the new pin was made; the old one's release failed
            log.warning("session %s: a previous pin stays until its TTL: %s", session.id, e)
        if outcome.refused:
            e = outcome.refused[-1]
            turn = core.records[-1].turn if core.records else 0
            session.pin_error = PinError(turn, e.status, e.reason, e.message)
            for e in outcome.refused:
                log.warning("session %s: pin refused: %s", session.id, e)
        elif outcome.made:
            session.pin_error = None

    def check_ttl(self, session: ProxySession, marker: Marker) -> None:
        """Log and count a marker whose TTL was not taken as sent (``markers.parse_ttl``)."""
        if marker.ttl_note == "clamped":
            self.counters.count(pin_ttl_clamped=1)
            log.warning(
                "session %s: cache_control ttl %r is above the maximum: pinned for %g s",
                session.id, marker.ttl, marker.ttl_s,
            )  # fmt: skip
        elif marker.ttl_note == "invalid":
            self.counters.count(pin_ttl_invalid=1)
            log.warning(
                "session %s: cache_control ttl %r is malformed or not positive: pinned for the "
                "default %g s", session.id, marker.ttl, marker.ttl_s,
            )  # fmt: skip

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in the background (held until done)."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def pin_then_release(
        self, session: ProxySession, pending: Pending, markers: Sequence[Marker]
    ) -> None:
        """A streamed turn's pins, after its stream ended; then the session's lock is released."""
        try:
            await self.pin_turn(session, pending, markers)
        finally:
            session.lock.release()

    async def fork_session(
        self, parent: ProxySession, child: ProxySession, cache_salt: str | None
    ) -> str | None:
        """Start ``child`` (new, its lock held) from ``parent`` (waits for its turn in flight);
        the error when the child starts cold instead: the copy was refused, or the request's
        ``cache_salt`` is not the parent's (another namespace: nothing of the parent's is
        reachable from it)."""
        async with parent.lock:
            if parent.backend is not None:
                child.backend = parent.backend
                child.core.placement.bind(parent.core.placement.client)
            child.forked_from = parent.id
            self.counters.count(forks=1)
            if (cache_salt or None) != parent.core.placement.salt:
                self.counters.count(fork_misses=1)
                return "the request's cache_salt is not the parent's"
            try:
                copied = await anyio.to_thread.run_sync(fork, child.core, parent.core)
            except ForkRejected as e:
                self.counters.count(fork_misses=1)
                log.warning("session %s: fork from %s refused: %s", child.id, parent.id, e)
                return str(e)
            self.counters.count(fork_copies=copied is not None)
            return None

    def release_session(self, session: ProxySession) -> None:
        """``SessionRegistry``'s ``on_drop``: release the session's pins in the background."""
        if not session.core.pins.pins:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the registry used outside the app
            log.warning("session %s ended outside the event loop: pins left to expire", session.id)
            return
        self.spawn(self._release(session))

    async def release_all(self, sessions: Iterable[ProxySession], timeout: float = 10.0) -> None:
        """The proxy shuts down: wait for the pins in flight, then release every pin of the live
        ``sessions`` (failures logged); at most ``timeout`` seconds in all (the rest expire)."""
        with anyio.move_on_after(timeout) as scope:
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            for session in sessions:
                if session.core.pins.pins:
                    await self._release(session, abandon_on_cancel=True)
        if scope.cancelled_caught:
            log.warning("shutting down: pins left to expire (no answer within %g s)", timeout)

    async def _release(self, session: ProxySession, abandon_on_cancel: bool = False) -> None:
        try:
            released = await anyio.to_thread.run_sync(
                session.core.pins.release, abandon_on_cancel=abandon_on_cancel
            )
        except PinRejected as e:
            log.warning("session %s: releasing its pins failed: %s", session.id, e)
            return
        self.counters.count(pins_released=released)
