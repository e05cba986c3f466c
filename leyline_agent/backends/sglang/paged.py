"""Slots on a paged KV pool (``--page-size`` > 1): what the splice executor allocates and frees.

SGLang's ``PagedTokenToKVPoolAllocator`` (``sglang/srt/mem_cache/allocator/paged.py``) hands out
whole pages (``alloc(n)`` needs ``n`` a page multiple) and frees whole pages (``free(slots)``
releases every page any of ``slots`` falls in: freeing one slot of a page frees all of it, and
freeing a page twice puts it twice on the free list). A sequence keeps ``slot % page ==
position % page``, its positions ``[k·page, (k+1)·page)`` in one page. Hence:

- ``fresh_slots``: slots for new positions ``[start, start + n)`` that continue the page of the
  previous position's slot when ``start`` is inside a page (that page is the splice's: a fresh
  page or the copied head of the first edited page), then whole fresh pages; the same rule as
  ``alloc_extend``'s ``last_loc`` (which the replacement prefill goes through).
- ``release``: free what a splice owns exactly once per page, skipping pages already free (a
  failed replacement prefill frees the pages its ``alloc_extend`` touched, the continued one
  included, which the splice's ledger also holds).

- ``purge_tail``: FORGET in the uncached partial page (``paged_plan.PagedPlan.forget_tail``).

With ``page == 1`` the first two are the plain allocator calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from leyline_agent.backends.sglang.errors import SpliceError

if TYPE_CHECKING:
    from leyline_agent.backends.sglang.compat import TreeNode
    from leyline_agent.backends.sglang.radix import LeylineRadixCache


def page_size(allocator: Any) -> int:
    return int(getattr(allocator, "page_size", 1) or 1)


def fresh_slots(
    alloc: Callable[[int], torch.Tensor], page: int, last: int | None, start: int, n: int
) -> torch.Tensor:
    """int64 ``[n]`` slots for new positions ``[start, start + n)``.

    ``alloc(k)``: ``k`` fresh slots, ``k`` a page multiple, whole pages (``Ledger.alloc``, which
    owns them). ``last``: the slot of position ``start - 1`` (needed when ``start % page``),
    whose page's remaining slots are used first. Raises ``ValueError`` when ``last`` does not
    sit where position ``start - 1`` must.
    """
    if page == 1:
        return alloc(n) if n else torch.empty((0,), dtype=torch.int64)
    parts = []
    off = start % page
    head = min(n, page - off) if off else 0
    if head:
        if last is None or (last + 1) % page != off:
            raise ValueError(f"slot {last} cannot precede position {start} on {page}-token pages")
        parts.append(torch.arange(last + 1, last + 1 + head, dtype=torch.int64))
    rest = n - head
    if rest > 0:
        pages = alloc(-(-rest // page) * page)
        parts.append(pages[:rest].to(torch.int64))
    if not parts:
        return torch.empty((0,), dtype=torch.int64)
    return torch.cat(parts)


def free_page_ids(allocator: Any) -> torch.Tensor:
    """Pages on a paged allocator's free lists (``free_pages`` and ``staged_pages``), int64."""
    parts = [
        getattr(allocator, "free_pages", None),
        *(getattr(allocator, "staged_pages", []) or []),
    ]
    kept = [p.to(torch.int64).flatten() for p in parts if p is not None and p.numel()]
    return torch.cat(kept) if kept else torch.empty((0,), dtype=torch.int64)


def release(allocator: Any, owned: Sequence[torch.Tensor | None]) -> None:
    """Free every slot in ``owned`` once: on a paged pool each page once, and not a page that is
    already free."""
    slots = [t.to(torch.int64).flatten() for t in owned if t is not None and t.numel()]
    if not slots:
        return
    page = page_size(allocator)
    if page == 1:
        for t in slots:
            allocator.free(t)
        return
    pages = torch.unique(torch.cat(slots).cpu() // page)
    pages = pages[~torch.isin(pages, free_page_ids(allocator).cpu())]
    if pages.numel():
        allocator.free((pages * page).to(slots[0].device))


def purge_tail(tree: LeylineRadixCache, node: TreeNode, tail: Sequence[int]) -> int:
    """Purge the subtrees below ``node`` whose first tokens are ``tail`` (the uncached partial
    page of a sequence ending at ``node``, which a FORGET in it removes). Returns the slots freed.
    Raises ``SpliceError`` 409 (nothing purged) while a running request holds one of them."""
    hit = [
        ch
        for ch in node.children.values()
        if [int(t) for t in ch.key[: len(tail)]] == [int(t) for t in tail]
    ]
    if any(n.lock_ref for ch in hit for n in tree.subtree_nodes(ch)):
        raise SpliceError(409, "FORGET: a running request still uses the span to purge; retry")
    return sum(tree.purge_subtree(node, ch) for ch in hit)
