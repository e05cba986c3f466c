"""Scheduler-side execution of a splice (runs in SGLang's scheduler process, between batches).

Index regions of one AMORTIZE splice with directives ``d_0 < d_1 < ...`` over a cached sequence of
length ``L`` (old coordinates on the left, what the new sequence gets on the right)::

    [0, d_0.start)             prefix      -> tree-owned slots, reused as they are
    [d_i.start, d_i.end)       removed     -> dropped (freed when the tail is owned in place)
    replacement_i              new         -> prefilled through SGLang's extend path, attending
                                              to the new sequence before it
    [d_i.end, d_{i+1}.start)   middle      -> copied to fresh slots, RoPE band δ-rotated by the
                                              cumulative delta (a later replacement attends to it)
    [d_last.end, L)            tail        -> δ-rotated in place when this path alone owns it,
                                              else copied first (copy-on-write)
    below L (one unshared      extension   -> (typically the previous reply) dropped with the
      unlocked chain)                         removed spans when the tail is taken in place

FORGET from position ``f`` (the first FORGET directive): AMORTIZE directives before ``f`` are
spliced as above; everything of the new sequence from ``f`` on is re-prefilled, and every tree
node that held an old position ``>= f`` on this path (and its subtree) is purged.

Ownership and eviction (the pool is full in production, so every allocation below may evict any
unlocked tree node):

1. Preflight, before any lock or allocation: request, tree type, page size, pool type, RoPE spec,
   namespace match (409), capacity (503). A refusal changes nothing.
2. Lock the deepest node the splice will read, copy, detach or purge: the end of the extension
   when there is one, else the end of ``tokens``. ``inc_lock_ref`` protects the whole root path,
   so no allocation of this splice can evict what it works on.
3. Phase 1 (fallible, not destructive): replacement prefills, middle/tail copies. The new slots
   belong to the splice's ledger.
4. Phase 2 (commit): unlock, purge (FORGET), detach the in-place chain (its slots move to the
   ledger), rotate the tail in place, insert the new sequence (the tree takes the slots), free
   what was dropped. No allocation happens in phase 2, so nothing can be evicted under it.

Any exception releases the ledger: every slot the splice holds is freed and its lock dropped, so
``free + cached == total`` holds and the scheduler keeps running. Up to the commit the cache is as
before; a failure inside phase 2 after the detach drops the edited sequence from ``d_0.start`` on
(the cache never holds wrong KV, it only misses).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from array import array
from typing import TYPE_CHECKING

import torch
from pydantic import ValidationError

from leyline_agent.backends.sglang import integrity
from leyline_agent.backends.sglang.kv_layout import (
    KVLayout,
    UnsupportedKV,
    check_full_attention,
    kv_layout,
)
from leyline_agent.backends.sglang.ledger import FaultInjector, InjectedFault, Ledger, Timer
from leyline_agent.backends.sglang.prefill import prefill_tokens
from leyline_agent.backends.sglang.protocol import SpliceRequest, SpliceResponse
from leyline_agent.backends.sglang.radix import LeylineRadixCache
from leyline_agent.backends.sglang.served_rope import served_model, served_rope
from leyline_agent.directive import DirectiveError, Mode, plan_edit, sort_and_check
from leyline_agent.kernels.rope import RopeBand, RopeSpec

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler import Scheduler

logger = logging.getLogger(__name__)


class SpliceError(Exception):
    """A splice that cannot run; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _debug() -> bool:
    return os.environ.get("LEYLINE_DEBUG_ENDPOINTS") == "1"


class SpliceExecutor:
    """Executes ``SpliceRequest`` payloads against one scheduler's tree and KV pool."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self._layout: KVLayout | None = None
        self._rope: tuple[RopeSpec, RopeBand, str] | None = None

    # ---- entry points ------------------------------------------------------------------------
    def handle(self, payload: str) -> tuple[int, str]:
        """Returns ``(http_status, json_body)``; never raises."""
        try:
            req = SpliceRequest.model_validate_json(payload)
        except ValidationError as e:
            return 422, json.dumps({"error": "invalid splice request", "detail": e.errors()})
        try:
            resp = self.splice(req)
        except SpliceError as e:
            return e.status, json.dumps({"error": str(e)})
        except DirectiveError as e:
            return 400, json.dumps({"error": str(e)})
        except Exception as e:  # never take the scheduler down; the ledger was released
            if not isinstance(e, InjectedFault):
                logger.exception("leyline splice failed")
            return 500, json.dumps({"error": f"splice failed and was rolled back: {e!r}"})
        return 200, resp.model_dump_json()

    def inspect(self, payload: str) -> tuple[int, str]:
        """``stats`` always; ``rows`` / ``tree_slots`` only with ``LEYLINE_DEBUG_ENDPOINTS=1``."""
        try:
            req = json.loads(payload)
            op = req.get("op")
            if op == "stats":
                return 200, json.dumps(integrity.stats(self.scheduler))
            if not _debug():
                return 403, json.dumps({"error": "debug endpoints are disabled"})
            if op == "rows":
                try:
                    spec, band, source = self._rope_spec()
                    rope = {"spec": dataclasses.asdict(spec), "band": band, "source": source}
                except SpliceError as e:
                    rope = {"error": str(e)}
                body = integrity.rows(
                    self.tree, self._kv_buffers(), req["tokens"], req.get("extra_key"), rope
                )
                return 200, json.dumps(body)
            if op == "tree_slots":
                return 200, json.dumps({"slots": self.tree.all_slots().tolist()})
            return 400, json.dumps({"error": f"unknown op {op!r}"})
        except Exception as e:
            logger.exception("leyline inspect failed")
            return 500, json.dumps({"error": repr(e)})

    # ---- preflight: everything checkable before the first lock or allocation ----------------
    @property
    def tree(self) -> LeylineRadixCache:
        tree = self.scheduler.tree_cache
        if not isinstance(tree, LeylineRadixCache):
            raise SpliceError(
                501,
                f"the server's radix cache is {type(tree).__name__}; splices need "
                "'--radix-cache-backend leyline' (leyline serve sets it)",
            )
        if tree.page_size != 1:
            raise SpliceError(501, f"splices need --page-size 1 (server has {tree.page_size})")
        return tree

    def _kv_buffers(self) -> KVLayout:
        """The pool's per-layer buffers by kind (``kv_layout``); 501 for pools not wired in."""
        if self._layout is None:
            pool = self.scheduler.token_to_kv_pool_allocator.get_kvcache()
            try:
                layout = kv_layout(pool)
                check_full_attention(served_model(self.scheduler))
            except UnsupportedKV as e:
                raise SpliceError(501, f"splices are not supported on this model: {e}") from e
            self._layout = layout
        return self._layout

    def _rope_spec(self) -> tuple[RopeSpec, RopeBand, str]:
        """The served model's RoPE (``served_rope``: its rotary modules, else the config), the
        band it occupies in a cache row, and the source ("model" or "config")."""
        if self._rope is None:
            layout = self._kv_buffers()
            cfg = self.scheduler.model_config.hf_config.to_dict()
            try:
                spec, source = served_rope(served_model(self.scheduler), cfg)
                band = layout.band(spec)
            except (ValueError, KeyError, TypeError) as e:
                raise SpliceError(501, f"splices are not supported on this model: {e}") from e
            self._rope = (spec, band, source)
        return self._rope

    def _preflight(self, req: SpliceRequest) -> LeylineRadixCache:
        tree = self.tree
        self._kv_buffers()
        self._rope_spec()
        vocab = self.scheduler.model_config.vocab_size
        for name, ids in [("tokens", req.tokens)] + [
            (f"directives[{i}].replacement", d.replacement) for i, d in enumerate(req.directives)
        ]:
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise SpliceError(400, f"{name}: token ids out of range [0, {vocab}): {bad[:5]}")
        if self.scheduler.req_to_token_pool.available_size() < 1:
            raise SpliceError(503, "no free request slot for the replacement prefill; retry")
        return tree

    # ---- phase-1 steps -----------------------------------------------------------------------
    def _alloc(self, n: int, ledger: Ledger, fault: FaultInjector) -> torch.Tensor:
        from sglang.srt.mem_cache.allocation import alloc_token_slots

        if n == 0:
            return torch.empty((0,), dtype=torch.int64, device=self.tree.device)
        fault("alloc")
        try:
            slots = alloc_token_slots(self.tree, n)
        except Exception as e:  # SGLang raises RuntimeError on exhaustion
            raise SpliceError(503, f"KV pool exhausted: cannot allocate {n} slots ({e})") from e
        if slots is None:
            raise SpliceError(503, f"KV pool exhausted: cannot allocate {n} slots")
        return ledger.own(slots.to(torch.int64))

    def _rotate(self, src: torch.Tensor, dst: torch.Tensor, old: range, delta: int) -> None:
        from leyline_agent.kernels.delta_rotation import delta_rotate

        if src.numel() == 0:
            return
        spec, band, _ = self._rope_spec()
        layout = self._kv_buffers()
        old_pos = torch.arange(old.start, old.stop, dtype=torch.int64, device=src.device)
        delta_rotate(
            layout.rotated, src, dst, old_pos, old_pos + delta, spec, band,
            copy_buffers=layout.copied,
        )  # fmt: skip

    # ---- the splice --------------------------------------------------------------------------
    def splice(self, req: SpliceRequest) -> SpliceResponse:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        t0 = time.perf_counter()
        timer = Timer()
        tree = self._preflight(req)
        ordered = sort_and_check(req.directives, len(req.tokens))
        fault = FaultInjector(req.debug_fault if _debug() else None)
        if req.debug_fail_after_prefill and _debug():
            fault = FaultInjector("commit")

        key = RadixKey(array("q", req.tokens), req.extra_key, cache_salt=req.cache_salt)
        match = tree.match_prefix(MatchPrefixParams(key=key))
        cached = int(match.device_prefix_len)
        if cached < len(req.tokens):
            raise SpliceError(
                409,
                f"sequence not cached in namespace extra_key={req.extra_key!r}"
                f"{f', cache_salt={req.cache_salt!r}' if req.cache_salt else ''}: only {cached} of "
                f"{len(req.tokens)} tokens are cached (evicted, flushed, or never sent); "
                "send the full request instead (it will be prefilled)",
            )
        last_node = match.last_device_node
        old_slots = tree.path_device_indices(last_node)[:cached].to(torch.int64)
        forget_at = min((d.start for d in ordered if d.mode is Mode.FORGET), default=None)
        amortized = [d for d in ordered if forget_at is None or d.start < forget_at]
        first = ordered[0].start
        new_tokens = plan_edit(req.tokens, ordered).new_tokens

        ledger = Ledger(tree)
        try:
            ledger.lock(last_node)
            fault("lock")
            parent, chain = tree.chain_from(last_node, first)
            # Tokens cached past `tokens` on one unshared, unlocked branch (typically the previous
            # reply) are not part of the sequence: an in-place splice drops them. They stay
            # evictable (phase 1 may need their room); the commit detaches what is left of them.
            extension = tree.single_chain_below(last_node)
            in_place = extension is not None and tree.chain_is_exclusive(
                chain + extension, own_locks=1
            )
            if forget_at is not None:
                self._check_forget_span(tree, last_node, forget_at, ledger)
            needed = len(new_tokens) - first  # an in-place tail keeps its slots
            if in_place and forget_at is None and amortized:
                needed -= cached - amortized[-1].end
            self._check_capacity(tree, needed)
            new_slots, counts = self._phase1(
                req, new_tokens, old_slots, amortized, forget_at, in_place, ledger, fault, timer
            )
            fault("commit")
            with timer("tree"):
                purged, in_place = self._commit(
                    tree, req, ledger, fault, timer, last_node, parent, chain, in_place,
                    forget_at, amortized, old_slots, new_slots, new_tokens, first, cached,
                )  # fmt: skip
        except BaseException as e:
            dropped = ledger.detached is not None
            ledger.rollback()
            if dropped and not isinstance(e, SpliceError):
                raise SpliceError(
                    500,
                    f"splice failed during its commit and was rolled back ({e!r}); the cached "
                    f"sequence from position {first} on was dropped (a later request re-prefills it)",
                ) from e
            raise
        timings = timer.as_ms()
        timings["tree"] = max(0.0, timings.pop("tree", 0.0) - timings.get("rotate_tail", 0.0))
        timings["rotate"] = timings.pop("rotate", 0.0) + timings.pop("rotate_tail", 0.0)
        return SpliceResponse(
            new_length=len(new_tokens),
            prefix_reused=first,
            prefilled=counts["prefilled"],
            rotated=counts["rotated"],
            copied=counts["copied"],
            purged=purged,
            in_place=in_place,
            elapsed_ms=(time.perf_counter() - t0) * 1e3,
            cached_before=cached,
            timings_ms=timings,
        )

    def _check_forget_span(self, tree, last_node, forget_at: int, ledger: Ledger) -> None:
        _, f_chain = tree.chain_from(last_node, forget_at)
        if not f_chain:
            return
        ours = ledger.locked_path()
        if any(n.lock_ref > (1 if n in ours else 0) for n in tree.subtree_nodes(f_chain[0])):
            raise SpliceError(409, "FORGET: a running request still uses the span to purge; retry")

    def _check_capacity(self, tree: LeylineRadixCache, needed: int) -> None:
        """Room counts free slots and unlocked tree nodes (this splice's path is locked)."""
        room = int(tree.token_to_kv_pool_allocator.available_size()) + int(tree.evictable_size())
        if needed > room:
            raise SpliceError(
                503,
                f"KV pool too small for this splice: needs {needed} slots, {room} free or "
                "evictable (the rest is in use or locked); retry later or send the full request",
            )

    def _phase1(
        self, req, new_tokens, old_slots, amortized, forget_at, in_place, ledger, fault, timer
    ):
        """Replacement prefills and middle/tail copies. Returns the new sequence's slots."""
        cached = int(old_slots.numel())
        parts: list[torch.Tensor] = [old_slots[: amortized[0].start if amortized else forget_at]]
        counts = {"prefilled": 0, "rotated": 0, "copied": 0}
        acc = 0
        for i, d in enumerate(amortized):
            prefix = torch.cat(parts)
            if d.replacement:
                upto = int(prefix.numel()) + len(d.replacement)
                with timer("prefill"):
                    parts.append(self._prefill(new_tokens[:upto], prefix, req, ledger, fault))
                counts["prefilled"] += len(d.replacement)
            acc += d.delta
            seg_end = amortized[i + 1].start if i + 1 < len(amortized) else cached
            if forget_at is not None:
                seg_end = min(seg_end, forget_at)
            seg = old_slots[d.end : seg_end]
            if seg.numel() == 0:
                continue
            if i + 1 == len(amortized) and forget_at is None and in_place:
                parts.append(seg)  # the tail: rotated in place in phase 2
            else:
                dst = self._alloc(int(seg.numel()), ledger, fault)
                fault("rotate")
                with timer("rotate"):
                    self._rotate(seg, dst, range(d.end, seg_end), acc)
                parts.append(dst)
                counts["copied"] += int(seg.numel())
            counts["rotated"] += int(seg.numel())
        if forget_at is not None:
            with timer("prefill"):
                tail = self._prefill(new_tokens, torch.cat(parts), req, ledger, fault)
            parts.append(tail)
            counts["prefilled"] += int(tail.numel())
        new_slots = torch.cat(parts)
        if new_slots.numel() != len(new_tokens):
            raise SpliceError(500, "internal: slot plan does not cover the new sequence")
        return new_slots, counts

    def _prefill(self, tokens, prefix, req, ledger: Ledger, fault: FaultInjector) -> torch.Tensor:
        s = self.scheduler
        slots = prefill_tokens(s, self.tree, tokens, prefix, req.extra_key, req.cache_salt, fault)
        return ledger.own(slots)

    def _commit(
        self, tree, req, ledger, fault, timer, last_node, parent, chain, in_place,
        forget_at, amortized, old_slots, new_slots, new_tokens, first, cached,
    ):  # fmt: skip
        """Phase 2: no allocation, so nothing can be evicted under it."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        ledger.unlock()
        purged = 0
        dropped = None
        if forget_at is not None:
            f_parent, f_chain = tree.chain_from(last_node, forget_at)
            if f_chain:
                fault("purge")
                purged = tree.purge_subtree(f_parent, f_chain[0])
            in_place = False  # the chain from `first` up to forget_at stays for other users
        elif in_place and (chain or tree.single_chain_below(last_node)):
            extension = tree.single_chain_below(last_node)  # what eviction left of it
            if extension is None:
                raise SpliceError(500, "internal: the chain below the sequence changed")
            chain = chain + extension
            fault("detach")
            mine = ledger.take(tree.detach_chain(parent, chain))
            last = amortized[-1]
            keep = torch.zeros(int(mine.numel()), dtype=torch.bool)
            keep[last.end - first : cached - first] = True
            dropped = mine[~keep]
            acc = sum(d.delta for d in amortized)
            fault("rotate_tail")
            with timer("rotate_tail"):
                tail = old_slots[last.end : cached]
                self._rotate(tail, tail, range(last.end, cached), acc)
        fault("insert")
        new_key = RadixKey(array("q", new_tokens), req.extra_key, cache_salt=req.cache_salt)
        result = tree.insert(InsertParams(key=new_key, value=new_slots))
        ledger.release_to_tree()  # the tree owns new_slots now (duplicates freed just below)
        dup = new_slots[first : max(first, int(result.prefix_len))]
        for t in (dup, dropped):
            if t is not None and t.numel():
                tree.token_to_kv_pool_allocator.free(t)
        return purged, bool(in_place and chain)
