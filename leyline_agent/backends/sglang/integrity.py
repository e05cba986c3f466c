"""Read-only views of one scheduler's tree and KV pool: ``/leyline/stats`` and the debug rows.

``stats`` is what every integrity test and the fuzz/soak scripts check after each operation. When
the server is idle (none of the busy states SGLang itself knows: ``busy.py``; they are listed
under ``busy``, and while there is one ``ok`` is None unless the structure is broken) it
requires:

- ``free + cached == total`` (nothing held by a request row, nothing leaked);
- no slot owned twice: not by two tree nodes, not by the tree and the free list;
- ``evictable + protected == cached``, and ``protected == pinned_slots`` (no lock left behind but
  the pins', ``pins.py``);
- SGLang's own idle check (``scheduler_components/invariant_checker.py``):
  ``available + evictable + protected == total``.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Any

import torch

from leyline_agent.backends.sglang.busy import busy_states
from leyline_agent.backends.sglang.kv_layout import KVLayout
from leyline_agent.backends.sglang.radix import LeylineRadixCache

if TYPE_CHECKING:
    from leyline_agent.backends.sglang.compat import Scheduler


def free_slots(allocator: Any) -> torch.Tensor:
    """The allocator's free slots, int64, any order: ``free_pages`` plus ``release_pages`` and
    (paged allocators) ``staged_pages``, each page expanded to its ``page_size`` slots."""
    staged = getattr(allocator, "staged_pages", None) or []
    parts = [getattr(allocator, "free_pages", None), getattr(allocator, "release_pages", None)]
    parts = [p.to(torch.int64) for p in [*parts, *staged] if p is not None and p.numel()]
    pages = torch.cat(parts) if parts else torch.empty((0,), dtype=torch.int64)
    size = int(getattr(allocator, "page_size", 1) or 1)
    if size == 1:
        return pages
    return (pages[:, None] * size + torch.arange(size, dtype=torch.int64)).flatten()


def stats(scheduler: Scheduler) -> dict[str, Any]:
    """Allocator/tree counters and the integrity verdict ``ok`` (None while busy: ``busy`` names
    the states, ``busy.busy_states``)."""
    tree = scheduler.tree_cache
    if not isinstance(tree, LeylineRadixCache):
        return {"error": f"radix cache is {type(tree).__name__}, not leyline"}
    busy = busy_states(scheduler)
    idle = not busy
    alloc = tree.token_to_kv_pool_allocator
    tree_slots = tree.all_slots().cpu()
    free = free_slots(alloc).cpu()
    cached, n_free, total = int(tree_slots.numel()), int(free.numel()), int(alloc.size)
    dup_tree = cached - int(torch.unique(tree_slots).numel()) if cached else 0
    both = torch.cat([tree_slots, free])
    dup_free = int(both.numel()) - int(torch.unique(both).numel()) - dup_tree if cached else 0
    evictable, protected = int(tree.evictable_size_), int(tree.protected_size_)
    in_use = total - n_free - cached
    out: dict[str, Any] = {
        "free": int(alloc.available_size()),
        "cached": cached,
        "in_use": in_use,
        "total": total,
        "evictable": evictable,
        "protected": protected,
        "duplicate_slots": dup_tree,
        "tree_and_free_list": dup_free,
        "idle": idle,
        "busy": busy,
        "sglang_idle_check": int(alloc.available_size()) + evictable + protected == total,
        **tree.pins.stats(),
    }
    structural = dup_tree == 0 and dup_free == 0 and evictable + protected == cached
    if idle:
        out["ok"] = (
            structural
            and in_use == 0
            and protected == out["pinned_slots"]
            and out["sglang_idle_check"]
        )
    else:
        out["ok"] = None if structural else False
    return out


def rows(
    tree: LeylineRadixCache,
    layout: KVLayout,
    tokens: list[int],
    extra_key: str | None,
    rope: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Cached length, slots and per-layer KV rows (values as fp32, and raw bit patterns).

    Debug only (``LEYLINE_DEBUG_ENDPOINTS=1``). MLA: ``values``/``bits`` per layer ``[n, width]``
    (the row ``[c_kv | k_pe]``). MHA/GQA: ``values``/``bits`` are K per layer
    ``[n, kv_heads, head_dim]`` and ``v_values``/``v_bits`` are V. ``rope``: the spec, band and
    source the server rotates with (the oracle a test must use), passed through as given.
    """
    from leyline_agent.backends.sglang.compat import MatchPrefixParams, RadixKey

    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens), extra_key)))
    n = int(m.device_prefix_len)
    slots = tree.path_device_indices(m.last_device_node)[:n].to(torch.int64)
    out: dict[str, Any] = {
        "cached": n,
        "slots": slots.tolist(),
        "dtype": str(layout.rotated[0].dtype),
        "kind": layout.kind,
    }
    if layout.quant is not None:
        out["dtype"] = str(layout.quant)
    squeeze = layout.kind == "mla"
    out["values"], out["bits"] = _dump(layout.rotated, slots, squeeze, layout.quant)
    if layout.copied:
        out["v_values"], out["v_bits"] = _dump(layout.copied, slots, False, layout.quant)
    if rope is not None:
        out["rope"] = rope
    return out


def _dump(
    bufs: list[torch.Tensor], slots: torch.Tensor, squeeze: bool, quant: torch.dtype | None
) -> tuple[list, list]:
    int_view = {1: torch.int8, 2: torch.int16, 4: torch.int32}
    values, bits = [], []
    for buf in bufs:
        r = buf[slots] if quant is None else buf[slots].view(quant)
        if squeeze:
            r = r[:, 0, :]
        values.append(r.float().tolist())
        bits.append(r.contiguous().view(int_view[r.element_size()]).tolist())
    return values, bits
