"""PIN: keep a cached prefix resident for a TTL (``POST /leyline/pin``, ``/leyline/unpin``).

An agent sits idle for seconds to minutes while a tool runs; under pool pressure LRU evicts
exactly that session's KV. A pin holds one lock reference (SGLang's ``inc_lock_ref``, the lock a
running request holds) on the node where the prefix ends, so the whole root path is protected:
never evicted, never detached or purged by another splice (a splice over it copies instead).

Release: ``/leyline/unpin`` (by ``pin_id`` or by ``owner``), or the TTL. Expiry is checked before
every eviction (``LeylineRadixCache.evict``), at the top of every scheduler iteration
(``Scheduler.get_next_batch_to_run``, so admission control sees the freed room) and on every
Leyline request. A FORGET over a pinned span releases the pins that hold it (a forget is a
stronger request than a retention hint); nothing else does.

Cap: the slots under pins (a slot under several pins counts once) may not exceed
``max_fraction`` of the pool (``leyline serve --max-pinned-fraction``, env
``LEYLINE_MAX_PINNED_FRACTION``, default 0.5): a pin beyond it is refused with 429 and changes
nothing, so pins can never starve running requests of the whole pool.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from leyline_agent.backends.sglang.errors import SpliceError

if TYPE_CHECKING:
    from leyline_agent.backends.sglang.compat import TreeNode
    from leyline_agent.backends.sglang.radix import LeylineRadixCache

DEFAULT_MAX_PINNED_FRACTION = 0.5
ENV_MAX_PINNED_FRACTION = "LEYLINE_MAX_PINNED_FRACTION"


def max_pinned_fraction() -> float:
    """``LEYLINE_MAX_PINNED_FRACTION`` (``leyline serve --max-pinned-fraction``), in [0, 1]."""
    raw = os.environ.get(ENV_MAX_PINNED_FRACTION)
    value = float(raw) if raw else DEFAULT_MAX_PINNED_FRACTION
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{ENV_MAX_PINNED_FRACTION}={raw}: must be in [0, 1]")
    return value


@dataclass
class Pin:
    pin_id: str
    node: TreeNode  # where the pinned prefix ends (its root path is locked)
    tokens: int
    expires_at: float  # Unix time, seconds
    owner: str | None


class Pins:
    """The pins of one scheduler's tree. Not thread-safe (the scheduler is one thread)."""

    def __init__(
        self,
        tree: LeylineRadixCache,
        max_fraction: float | None = None,
        clock: Callable[[], float] = time.time,
        prefix: str = "p",
    ) -> None:
        self.tree = tree
        self.max_fraction = max_pinned_fraction() if max_fraction is None else max_fraction
        self.clock = clock
        self.prefix = prefix  # pin ids start with it (the DP rank, so unpin can be routed)
        self.pins: dict[str, Pin] = {}

    def __len__(self) -> int:
        return len(self.pins)

    # ---- what is pinned ----
    def _path(self, node: TreeNode) -> list[TreeNode]:
        out = []
        while node is not None and node is not self.tree.root_node:
            out.append(node)
            node = node.parent
        return out

    def _nodes(self, extra: Iterable[TreeNode] = ()) -> set[TreeNode]:
        out: set[TreeNode] = set(extra)
        for p in self.pins.values():
            out.update(self._path(p.node))
        return out

    def pinned_slots(self) -> int:
        """Slots under at least one pin."""
        return sum(len(n.value) for n in self._nodes() if n.value is not None)

    def cap_slots(self) -> int:
        return int(self.max_fraction * int(self.tree.token_to_kv_pool_allocator.size))

    def locks_on(self, node: TreeNode) -> int:
        """Lock references the pins hold on ``node`` (one per pin whose path runs through it)."""
        return sum(1 for p in self.pins.values() if node in self._path(p.node))

    # ---- pin / unpin ----
    def pin(self, node: TreeNode, tokens: int, ttl_s: float, owner: str | None) -> Pin:
        """Lock ``node``'s root path for ``ttl_s`` seconds.

        Raises:
            SpliceError: 429 when the pinned slots would exceed the cap (nothing pinned then).
        """
        self.expire()
        nodes = self._nodes(self._path(node))
        after = sum(len(n.value) for n in nodes if n.value is not None)
        cap = self.cap_slots()
        if after > cap:
            raise SpliceError(
                429,
                f"pin refused: {after} slots would be pinned, over the cap of {cap} "
                f"({self.max_fraction:.0%} of the pool, --max-pinned-fraction); unpin or wait "
                "for pins to expire",
            )
        self.tree.inc_lock_ref(node)
        pin = Pin(f"{self.prefix}-{uuid.uuid4().hex}", node, tokens, self.clock() + ttl_s, owner)
        self.pins[pin.pin_id] = pin
        return pin

    def _release(self, pin: Pin) -> None:
        del self.pins[pin.pin_id]
        self.tree.dec_lock_ref(pin.node)

    def unpin(self, pin_id: str) -> bool:
        """Release one pin; False when there is none by that id (unknown or expired)."""
        self.expire()
        pin = self.pins.get(pin_id)
        if pin is None:
            return False
        self._release(pin)
        return True

    def release_owner(self, owner: str) -> int:
        """Release every pin of ``owner``; returns how many."""
        mine = [p for p in self.pins.values() if p.owner == owner]
        for p in mine:
            self._release(p)
        return len(mine)

    def release_under(self, nodes: set[TreeNode]) -> int:
        """Release the pins that end inside ``nodes`` (a FORGET's purged subtree)."""
        hit = [p for p in self.pins.values() if p.node in nodes]
        for p in hit:
            self._release(p)
        return len(hit)

    def expire(self) -> int:
        """Release the pins whose TTL has passed; returns how many."""
        if not self.pins:
            return 0
        now = self.clock()
        old = [p for p in self.pins.values() if p.expires_at <= now]
        for p in old:
            self._release(p)
        return len(old)

    def stats(self) -> dict[str, Any]:
        return {"pins": len(self.pins), "pinned_slots": self.pinned_slots()}
