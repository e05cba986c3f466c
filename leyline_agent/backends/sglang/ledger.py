"""What one splice holds (slots, a lock), its step timer, and the fault-injection test hook.

A slot is owned by exactly one of: the allocator's free list, one tree node, a live request row,
or a splice's :class:`Ledger`. ``Ledger.rollback`` frees every slot the ledger owns and drops its
lock, whatever step the splice was at; ``release_to_tree`` hands the slots over on commit.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from leyline_agent.backends.sglang.errors import SpliceError

if TYPE_CHECKING:
    from leyline_agent.backends.sglang.compat import TreeNode
    from leyline_agent.backends.sglang.radix import LeylineRadixCache

FAULT_POINTS = (
    "lock",  # after the lock, before any allocation
    "alloc",  # before each slot allocation for a middle/tail copy
    "prefill.alloc",  # right after each replacement prefill's slot allocation (before SGLang's
    # batch holds them: a failure there must not leak them)
    "prefill.prepare",  # after each replacement prefill's prepare_for_extend (slots allocated)
    "prefill.forward",  # before each replacement prefill's forward pass
    "rotate",  # before each copy-rotation
    "commit",  # end of phase 1, still locked
    "purge",  # FORGET: before the purge
    "detach",  # in place: before detaching the old chain
    "rotate_tail",  # in place: detached, before rotating the tail
    "insert",  # before inserting the new sequence
)


class InjectedFault(RuntimeError):
    """Raised by :class:`FaultInjector` (tests only)."""


class FaultInjector:
    """Raise :class:`InjectedFault` at the ``k``-th time step ``name`` is reached.

    ``spec``: ``"name"`` (first time) or ``"name#k"`` (1-based), a name from ``FAULT_POINTS``;
    None disables it. Only honoured with ``LEYLINE_DEBUG_ENDPOINTS=1`` (the executor decides).
    """

    def __init__(self, spec: str | None):
        self.name, self.k = None, 1
        if spec:
            name, _, k = spec.partition("#")
            if name not in FAULT_POINTS:
                raise ValueError(f"unknown fault point {name!r}; one of {FAULT_POINTS}")
            self.name, self.k = name, int(k or 1)
        self.seen: Counter[str] = Counter()

    def __call__(self, step: str) -> None:
        self.seen[step] += 1
        if step == self.name and self.seen[step] == self.k:
            raise InjectedFault(f"injected fault at {step}#{self.k}")


class Timer:
    """Accumulates wall time per named step (milliseconds)."""

    def __init__(self) -> None:
        self.ms: defaultdict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.ms[name] += (time.perf_counter() - t) * 1e3

    def as_ms(self) -> dict[str, float]:
        return dict(self.ms)


class Ledger:
    """Slots and the one lock a splice holds. Not thread-safe (the scheduler is one thread)."""

    def __init__(self, tree: LeylineRadixCache):
        self.tree = tree
        self.fresh: list[torch.Tensor] = []  # allocated by this splice
        self.detached: torch.Tensor | None = None  # taken out of the tree in phase 2
        self.locked: TreeNode | None = None

    def lock(self, node: TreeNode) -> None:
        self.tree.inc_lock_ref(node)
        self.locked = node

    def unlock(self) -> None:
        if self.locked is not None:
            self.tree.dec_lock_ref(self.locked)
            self.locked = None

    def locked_path(self) -> set[TreeNode]:
        out, node = set(), self.locked
        while node is not None and node is not self.tree.root_node:
            out.add(node)
            node = node.parent
        return out

    def alloc(self, n: int, fault: FaultInjector) -> torch.Tensor:
        """``n`` fresh slots (int64), owned by the splice; may evict unlocked tree nodes.

        Raises ``SpliceError`` 503 when the pool cannot give them.
        """
        from leyline_agent.backends.sglang.compat import alloc_token_slots

        fault("alloc")
        try:
            slots = alloc_token_slots(self.tree, n)
        except Exception as e:  # SGLang raises RuntimeError on exhaustion
            raise SpliceError(503, f"KV pool exhausted: cannot allocate {n} slots ({e})") from e
        if slots is None:
            raise SpliceError(503, f"KV pool exhausted: cannot allocate {n} slots")
        return self.own(slots.to(torch.int64))

    def own(self, slots: torch.Tensor) -> torch.Tensor:
        self.fresh.append(slots)
        return slots

    def take(self, slots: torch.Tensor) -> torch.Tensor:
        """Slots detached from the tree become the splice's."""
        self.detached = slots
        return slots

    def release_to_tree(self) -> None:
        self.fresh.clear()
        self.detached = None

    def rollback(self) -> None:
        """Free everything owned, drop the lock. Idempotent."""
        from leyline_agent.backends.sglang.paged import release

        # one free per page on paged pools (a replacement prefill's page may be in two entries)
        release(self.tree.token_to_kv_pool_allocator, [*self.fresh, self.detached])
        self.release_to_tree()
        self.unlock()
