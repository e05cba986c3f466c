"""The Leyline radix-cache backend: SGLang's Python ``RadixCache`` plus the tree surgery a splice
needs (detach a suffix chain without freeing it, purge a subtree, a staged prefix for the
replacement prefill, an integrity check), and the pins (``pins.py``: expired before each eviction).

Registered as ``--radix-cache-backend leyline`` through
``sglang.srt.mem_cache.registry.register_radix_cache_backend``. It keeps SGLang's own node and key
types (``TreeNode``, ``RadixKey``), so everything else in the scheduler keeps working.

Slot ownership, the invariant every method here preserves::

    allocator.available_size() + tree.total_size() + slots held by live request rows == pool size

A slot is owned by exactly one of: the allocator's free list, one tree node, a live request row,
or (for the duration of a splice only) the splice itself.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from leyline_agent.backends.sglang.compat import RadixCache, TreeNode
from leyline_agent.backends.sglang.pins import Pins

if TYPE_CHECKING:
    from leyline_agent.backends.sglang.compat import EvictParams, Req, TreeCacheBuildContext

logger = logging.getLogger(__name__)

BACKEND_NAME = "leyline"


class LeylineRadixCache(RadixCache):
    """``RadixCache`` with splice surgery. See the module docstring for the ownership invariant."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.staged_prefixes: dict[str, torch.Tensor] = {}  # rid -> prefix slots (int64)
        super().__init__(*args, **kwargs)
        self.pins = Pins(self)

    def reset(self) -> None:
        """SGLang's reset (``/flush_cache``): every node goes, so every pin goes with it."""
        pins = getattr(self, "pins", None)
        if pins is not None:
            pins.pins.clear()
        super().reset()

    def evict(self, params: EvictParams) -> Any:
        """SGLang's LRU eviction, after releasing the pins whose TTL has passed."""
        self.pins.expire()
        return super().evict(params)

    # ---- the replacement prefill reads its prefix from here, not from a tree path ----
    def stage_prefix(self, rid: str, slots: torch.Tensor) -> None:
        """Until :meth:`unstage_prefix`, request ``rid`` attends to ``slots`` as its prefix (a
        splice's replacement prefill: the edited sequence before it is not a tree path)."""
        self.staged_prefixes[rid] = slots

    def unstage_prefix(self, rid: str) -> None:
        self.staged_prefixes.pop(rid, None)

    def prefix_device_indices(self, req: Req) -> torch.Tensor:
        staged = self.staged_prefixes.get(req.rid)
        if staged is not None:
            return staged[: req.prefix_len]
        return super().prefix_device_indices(req)

    # ---- structure ----
    def chain_from(self, last_node: TreeNode, start: int) -> tuple[TreeNode, list[TreeNode]]:
        """Split the root path of ``last_node`` at token position ``start``.

        Returns ``(parent, chain)``: ``parent`` is the node whose path ends exactly at ``start`` and
        ``chain`` the nodes from there down to ``last_node`` (top first). The path's values are
        unchanged; only a node boundary may be added at ``start``.
        """
        path: list[TreeNode] = []
        node = last_node
        while node is not self.root_node:
            path.append(node)
            node = node.parent
        path.reverse()
        pos = 0
        for i, n in enumerate(path):
            if pos + len(n.key) > start:
                if pos < start:
                    upper = self._split_node(n.key, n, start - pos)
                    return upper, path[i:]
                return n.parent, path[i:]
            pos += len(n.key)
        return last_node, []

    def single_chain_below(self, node: TreeNode) -> list[TreeNode] | None:
        """Descendants of ``node`` when they form one unlocked chain (possibly empty), else None."""
        out: list[TreeNode] = []
        while node.children:
            if len(node.children) > 1:
                return None
            node = next(iter(node.children.values()))
            if node.lock_ref:
                return None
            out.append(node)
        return out

    def chain_is_exclusive(self, chain: list[TreeNode], own_locks: int) -> bool:
        """True when no other path or live request uses the chain's slots.

        ``own_locks`` is how many lock references the caller itself holds on the chain.
        """
        for i, n in enumerate(chain):
            if n.lock_ref > own_locks:
                return False
            allowed_children = 0 if i == len(chain) - 1 else 1
            if len(n.children) > allowed_children:
                return False
        return True

    def detach_chain(self, parent: TreeNode, chain: list[TreeNode]) -> torch.Tensor:
        """Remove an unlocked chain (as returned by :meth:`chain_from`) from the tree WITHOUT
        freeing its slots; the caller now owns them. Returns the slots, in path order."""
        if not chain:
            return torch.empty((0,), dtype=torch.int64, device=self.device)
        for n in chain:
            if n.lock_ref:
                raise RuntimeError("detach_chain: chain is locked")
        top = chain[0]
        popped = parent.children.pop(top.key.child_key(self.page_size), None)
        if popped is not top:
            raise RuntimeError("detach_chain: chain is not a child of parent")
        for n in chain:
            self.evictable_size_ -= len(n.key)
            self.evictable_leaves.discard(n)
            self.kv_events.record_remove(n)
        self._update_leaf_status(parent)
        return torch.cat([n.value for n in chain]).to(torch.int64)

    def subtree_nodes(self, top: TreeNode) -> list[TreeNode]:
        out, stack = [], [top]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def purge_subtree(self, parent: TreeNode, top: TreeNode) -> int:
        """Delete ``top`` and every descendant, freeing their slots. All must be unlocked.

        Returns the number of slots freed.
        """
        nodes = self.subtree_nodes(top)
        if any(n.lock_ref for n in nodes):
            raise RuntimeError("purge_subtree: a node in the subtree is in use")
        popped = parent.children.pop(top.key.child_key(self.page_size), None)
        if popped is not top:
            raise RuntimeError("purge_subtree: top is not a child of parent")
        freed = 0
        for n in nodes:
            self.token_to_kv_pool_allocator.free(n.value)
            freed += len(n.value)
            self.evictable_size_ -= len(n.key)
            self.evictable_leaves.discard(n)
            self.kv_events.record_remove(n)
        self._update_leaf_status(parent)
        return freed

    def all_slots(self) -> torch.Tensor:
        vals = [n.value for n in self.subtree_nodes(self.root_node) if n is not self.root_node]
        if not vals:
            return torch.empty((0,), dtype=torch.int64)
        return torch.cat(vals).to(torch.int64)

    def check_integrity(self, in_use: int = 0) -> dict[str, int | bool]:
        """free + cached + in use == total, and no slot in two nodes.

        ``in_use``: slots held by live request rows (0 when the server is idle).
        """
        alloc = self.token_to_kv_pool_allocator
        slots = self.all_slots()
        cached = int(slots.numel())
        unique = int(torch.unique(slots).numel()) if cached else 0
        free = int(alloc.available_size())
        total = int(alloc.size)
        return {
            "free": free,
            "cached": cached,
            "in_use": in_use,
            "total": total,
            "evictable": int(self.evictable_size_),
            "protected": int(self.protected_size_),
            "duplicate_slots": cached - unique,
            "ok": free + cached + in_use == total
            and cached == unique
            and cached == self.evictable_size_ + self.protected_size_,
        }


def leyline_radix_cache_factory(ctx: TreeCacheBuildContext) -> Any:
    """Factory for ``register_radix_cache_backend``. Only plain (non-hybrid) KV caches; with
    ``--enable-hierarchical-cache`` SGLang's own HiCache tree (``default_radix_cache_factory``):
    the server serves, and splices and forks answer 501 (``preflight.check_settings``)."""
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm:
        raise ValueError(
            "--radix-cache-backend leyline supports full-attention KV caches only "
            "(no SWA/SSM hybrids)"
        )
    if ctx.enable_hierarchical_cache:
        from leyline_agent.backends.sglang.compat import default_radix_cache_factory

        logger.warning(
            "--enable-hierarchical-cache: serving SGLang's own HiCache radix tree; splices and "
            "forks answer 501 (HiCache keys written-back pages by tokens only: docs/backend.md)"
        )
        return default_radix_cache_factory(ctx)
    return LeylineRadixCache(ctx.params)
