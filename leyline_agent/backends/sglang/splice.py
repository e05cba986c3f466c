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

``plan.py`` turns the directives into these regions (ops); this module executes them.

Across namespaces (``target_extra_key``: the session's private namespace, ``tokens`` matched in the
tenant's shared one): the prefix is copied to fresh slots (no prefill), nothing is taken in place,
the source path stays as it was, and the new sequence is inserted in the target namespace. A fork
is that with no directive: the whole sequence copied.

Under a LoRA adapter (``lora_path``), every match and insert uses the adapter's namespace
(``extra_key + lora_id``) and the prefills run with the adapter (``lora.py``).

FORGET from position ``f`` (the first FORGET directive): AMORTIZE directives before ``f`` are
spliced as above; everything of the new sequence from ``f`` on is re-prefilled, and every tree
node that held an old position ``>= f`` on this path (and its subtree) is purged, and the pins
(``pins.py``) that end in it are released.

Ownership and eviction (the pool is full in production, so every allocation below may evict any
unlocked tree node):

1. Preflight, before any lock or allocation: request, tree type, page size, pool type, RoPE spec,
   the new length against the server's context length (400), namespace match (409), capacity
   (503). A refusal changes nothing.
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

import json
import logging
import time
from array import array
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ValidationError

from leyline_agent.backends.sglang.errors import SpliceError, debug_enabled
from leyline_agent.backends.sglang.ledger import FaultInjector, InjectedFault, Ledger, Timer
from leyline_agent.backends.sglang.lora import lora_key, resolve
from leyline_agent.backends.sglang.paged import fresh_slots, purge_tail
from leyline_agent.backends.sglang.paged_plan import PagedPlan, plan_paged
from leyline_agent.backends.sglang.plan import (
    Copy,
    Keep,
    Prefill,
    PrefillFrom,
    Rotate,
    SplicePlan,
    plan_splice,
)
from leyline_agent.backends.sglang.prefill import prefill_tokens
from leyline_agent.backends.sglang.preflight import (
    Served,
    check_cached,
    check_capacity,
    check_context_length,
    check_forget_span,
)
from leyline_agent.backends.sglang.versions import ReplayStore, check_expected_state
from leyline_agent.directive import DirectiveError, plan_edit, sort_and_check
from leyline_agent.wire import (
    ForkRequest,
    ForkResponse,
    PinRequest,
    PinResponse,
    SpliceRequest,
    SpliceResponse,
    UnpinRequest,
    UnpinResult,
    state_id,
)

if TYPE_CHECKING:
    from leyline_agent.backends.sglang.compat import Scheduler, TreeNode

logger = logging.getLogger(__name__)


class SpliceExecutor:
    """Executes ``SpliceRequest`` payloads against one scheduler's tree and KV pool."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.served = Served(scheduler)
        self.duplicates = 0  # slots of the last commit that the target already held
        self.allocated = self.freed = 0  # slots the last commit took from / gave back to the pool
        self.replays = ReplayStore()  # idempotency keys (versions.py)
        self.lora_id: str | None = None  # the adapter of the splice running now (lora.py)

    def handle(self, payload: str, op: str = "splice") -> tuple[int, str]:
        """Run one control request (``op``: splice, fork, pin, unpin; ``payload``: its JSON
        body). Returns ``(http_status, json_body)``; never raises."""
        handlers: dict[str, tuple[type[BaseModel], Any]] = {
            "splice": (SpliceRequest, self.splice),
            "fork": (ForkRequest, self.fork),
            "pin": (PinRequest, self.pin),
            "unpin": (UnpinRequest, self.unpin),
        }
        if op not in handlers:
            return 400, json.dumps({"error": f"unknown op {op!r}"})
        model, run = handlers[op]
        try:
            req = model.model_validate_json(payload)
        except ValidationError as e:
            detail = json.loads(e.json(include_url=False, include_input=False))
            return 422, json.dumps({"error": f"invalid {op} request", "detail": detail})
        try:
            self.served.tree.pins.expire()
            if isinstance(req, SpliceRequest) and (replayed := self.replays.replay(req)):
                return 200, replayed
            resp = run(req)
        except SpliceError as e:
            return e.status, json.dumps(e.body())
        except DirectiveError as e:
            return 400, json.dumps({"error": str(e)})
        except Exception as e:  # never take the scheduler down; the ledger was released
            if not isinstance(e, InjectedFault):
                logger.exception("leyline splice failed")
            return 500, json.dumps({"error": f"{op} failed and was rolled back: {e!r}"})
        body = resp.model_dump_json()
        if isinstance(req, SpliceRequest):
            self.replays.remember(req, body)
        return 200, body

    # ---- fork, pin, unpin --------------------------------------------------------------------
    def fork(self, req: ForkRequest) -> ForkResponse:
        """Copy the cached ``req.tokens`` into ``req.target_extra_key`` (a splice with no
        directive across namespaces). 409 not cached, 503 no room; nothing changes then."""
        resp = self.splice(req.as_splice(), op="fork")
        return ForkResponse(
            new_length=resp.new_length,
            copied=resp.copied_prefix - self.duplicates,
            elapsed_ms=resp.elapsed_ms,
        )

    def pin(self, req: PinRequest) -> PinResponse:
        """Lock the cached prefix ``req.tokens`` for ``req.ttl_s`` (``pins.py``). 409 not cached,
        429 over the cap; nothing changes then."""
        from leyline_agent.backends.sglang.compat import MatchPrefixParams, RadixKey

        tree = self.served.tree
        if tree.page_size != 1:
            raise SpliceError(501, f"pins need --page-size 1 (server has {tree.page_size})")
        self.served.check_tokens(req.tokens)
        key = RadixKey(array("q", req.tokens), req.extra_key, cache_salt=req.cache_salt)
        match = tree.match_prefix(MatchPrefixParams(key=key))
        check_cached(req, int(match.device_prefix_len), "pin")
        pin = tree.pins.pin(match.last_device_node, len(req.tokens), req.ttl_s, req.owner)
        return PinResponse(
            pin_id=pin.pin_id,
            pinned_tokens=pin.tokens,
            ttl_s=req.ttl_s,
            expires_at=pin.expires_at,
            pinned_slots=tree.pins.pinned_slots(),
            pin_cap_slots=tree.pins.cap_slots(),
        )

    def unpin(self, req: UnpinRequest) -> UnpinResult:
        """Release one pin (404 when unknown or expired) or every pin of an owner."""
        pins = self.served.tree.pins
        if req.pin_id is not None:
            if not pins.unpin(req.pin_id):
                raise SpliceError(404, f"no pin {req.pin_id!r} (unknown, released or expired)")
            return UnpinResult(released=1, pinned_slots=pins.pinned_slots())
        assert req.owner is not None
        return UnpinResult(released=pins.release_owner(req.owner), pinned_slots=pins.pinned_slots())

    # ---- the splice --------------------------------------------------------------------------
    def splice(self, req: SpliceRequest, op: str = "splice") -> SpliceResponse:
        """Preflight, match (409), lock, plan, check room, phase 1, commit; see the module doc."""
        from leyline_agent.backends.sglang.compat import MatchPrefixParams, RadixKey

        t0 = time.perf_counter()
        timer = Timer()
        self.lora_id = lora_id = resolve(self.scheduler, req.lora_path)  # 400/503 (lora.py)
        tree = self.served.check(req)
        ordered = sort_and_check(req.directives, len(req.tokens)) if req.directives else []
        grown = sum(len(d.replacement) - (d.end - d.start) for d in ordered)
        check_context_length(self.scheduler, len(req.tokens), len(req.tokens) + grown)
        parent_state = check_expected_state(req)
        fault = FaultInjector(req.debug_fault if debug_enabled() else None)
        if req.debug_fail_after_prefill and debug_enabled():
            fault = FaultInjector("commit")

        ns_key = lora_key(req.extra_key, lora_id)
        key = RadixKey(array("q", req.tokens), ns_key, cache_salt=req.cache_salt)
        match = tree.match_prefix(MatchPrefixParams(key=key))
        cached, page = int(match.device_prefix_len), tree.page_size
        # a paged tree holds full pages only: all of them cached is all of it (paged_plan.py)
        check_cached(
            req,
            cached if not cached or cached < len(req.tokens) // page * page else len(req.tokens),
            op,
        )
        last_node = match.last_device_node
        old_slots = tree.path_device_indices(last_node)[:cached].to(torch.int64)
        first = min(ordered[0].start if ordered else len(req.tokens), cached) // page * page
        ledger = Ledger(tree)
        try:
            ledger.lock(last_node)
            fault("lock")
            # Tokens cached past `tokens` on one unshared, unlocked branch (typically the previous
            # reply) are not part of the sequence: an in-place splice drops them. They stay
            # evictable (phase 1 may need their room); the commit detaches what is left of them.
            # Across namespaces nothing of the source is taken: every slot is copied.
            chain: list[TreeNode] = []
            parent, in_place = last_node, False
            if not req.crosses:
                parent, chain = tree.chain_from(last_node, first)
                extension = tree.single_chain_below(last_node)
                in_place = extension is not None and tree.chain_is_exclusive(
                    chain + extension, own_locks=1
                )
            plan = (
                plan_splice(req.tokens, ordered, in_place=in_place, copy_prefix=req.crosses)
                if page == 1
                else plan_paged(
                    req.tokens, ordered, held=cached, page=page, in_place=in_place,
                    copy_prefix=req.crosses,
                )
            )  # fmt: skip
            if plan.purge is not None:
                check_forget_span(tree, last_node, plan.purge.old, ledger)
            check_capacity(tree, plan.needed_slots)
            new_slots = self._phase1(req, plan, old_slots, ledger, fault, timer)
            fault("commit")
            with timer("tree"):
                purged, took_chain = self._commit(
                    req, plan, ledger, fault, timer, last_node, parent, chain, old_slots, new_slots
                )
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
            new_length=plan.full_length if isinstance(plan, PagedPlan) else len(plan.new_tokens),
            prefix_reused=first,
            prefilled=plan.prefilled,
            rotated=plan.rotated,
            copied=plan.copied,
            purged=purged,
            copied_prefix=plan.copied_prefix,
            in_place=took_chain,
            elapsed_ms=(time.perf_counter() - t0) * 1e3,
            cached_before=cached,
            state_id=state_id(
                plan_edit(req.tokens, ordered).new_tokens, *req.target, req.lora_path
            ),
            parent_state_id=parent_state,
            slots_allocated=self.allocated,
            slots_freed=self.freed + purged,
            timings_ms=timings,
        )

    # ---- phase 1: fallible, not destructive; every new slot belongs to the ledger ------------
    def _phase1(
        self,
        req: SpliceRequest,
        plan: SplicePlan,
        old_slots: torch.Tensor,
        ledger: Ledger,
        fault: FaultInjector,
        timer: Timer,
    ) -> torch.Tensor:
        """Replacement prefills and middle/tail copies. Returns the new sequence's slots."""
        parts: list[torch.Tensor] = []
        for op in plan.ops:
            if isinstance(op, Keep):
                parts.append(old_slots[op.old.start : op.old.stop])
            elif isinstance(op, Copy) and op.old:
                dst = self._fresh(parts, op.new.start, len(op.old), ledger, fault)
                with timer("rotate"):
                    self._copy(old_slots[op.old.start : op.old.stop], dst)
                parts.append(dst)
            elif isinstance(op, (Prefill, PrefillFrom)):
                prefix, tokens = torch.cat(parts), plan.new_tokens[: op.new.stop]
                with timer("prefill"):
                    slots = prefill_tokens(
                        self.scheduler, self.served.tree, tokens, prefix,
                        req.target.extra_key, req.cache_salt, fault, self.lora_id,
                    )  # fmt: skip
                parts.append(ledger.own(slots))
            elif isinstance(op, Rotate) and op.in_place:
                parts.append(old_slots[op.old.start : op.old.stop])  # rotated in the commit
            elif isinstance(op, Rotate):
                dst = self._fresh(parts, op.new.start, len(op.old), ledger, fault)
                fault("rotate")
                with timer("rotate"):
                    self._rotate(old_slots[op.old.start : op.old.stop], dst, op.old, op.delta)
                parts.append(dst)
        new_slots = torch.cat(parts)
        if new_slots.numel() != len(plan.new_tokens):
            raise SpliceError(500, "internal: slot plan does not cover the new sequence")
        return new_slots

    def _fresh(
        self, parts: list[torch.Tensor], start: int, n: int, ledger: Ledger, fault: FaultInjector
    ) -> torch.Tensor:
        """Fresh slots for new positions ``[start, start + n)`` after ``parts`` (``paged.py``)."""
        page = self.served.tree.page_size
        last = next((int(p[-1]) for p in reversed(parts) if p.numel()), None)
        return fresh_slots(lambda k: ledger.alloc(k, fault), page, last, start, n)

    def _copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Rows ``src`` copied to ``dst`` bit for bit, in every per-layer buffer."""
        layout = self.served.kv_buffers()
        for buf in [*layout.rotated, *layout.copied]:
            buf[dst] = buf[src]

    def _rotate(self, src: torch.Tensor, dst: torch.Tensor, old: range, delta: int) -> None:
        from leyline_agent.kernels.delta_rotation import delta_rotate

        if src.numel() == 0:
            return
        spec, band, _ = self.served.rope_spec()
        layout = self.served.kv_buffers()
        old_pos = torch.arange(old.start, old.stop, dtype=torch.int64, device=src.device)
        if layout.quant is None:
            delta_rotate(
                layout.rotated, src, dst, old_pos, old_pos + delta, spec, band,
                copy_buffers=layout.copied,
            )  # fmt: skip
            return
        # fp8 stored as bytes: dequantize the rows to fp32, rotate them there, quantize back
        rows = torch.arange(src.numel(), dtype=torch.int64, device=src.device)
        for buf in layout.rotated:
            tmp = buf[src].view(layout.quant).float()
            delta_rotate([tmp], rows, rows, old_pos, old_pos + delta, spec, band)
            big = torch.finfo(layout.quant).max  # a turned pair may exceed it: saturate
            buf[dst] = tmp.clamp_(-big, big).to(layout.quant).view(buf.dtype)
        if not torch.equal(src, dst):
            for buf in layout.copied:
                buf[dst] = buf[src]

    # ---- phase 2: the commit; no allocation, so nothing can be evicted under it -------------
    def _commit(
        self, req: SpliceRequest, plan: SplicePlan, ledger: Ledger, fault: FaultInjector,
        timer: Timer, last_node: TreeNode, parent: TreeNode, chain: list[TreeNode],
        old_slots: torch.Tensor, new_slots: torch.Tensor,
    ) -> tuple[int, bool]:  # fmt: skip
        """Purge (FORGET) or detach and rotate the tail in place, insert, free what was dropped.
        Returns ``(purged slots, whether the old chain was taken in place)``."""
        from leyline_agent.backends.sglang.compat import InsertParams, RadixKey

        tree = self.served.tree
        ledger.unlock()
        purged, dropped, first, cached = 0, None, plan.first, int(old_slots.numel())
        if isinstance(plan, PagedPlan) and plan.forget_tail:  # paged.py
            purged += purge_tail(tree, last_node, plan.forget_tail)
        if plan.purge is not None:  # the chain from `first` up to forget_at stays for others
            f_parent, f_chain = tree.chain_from(last_node, plan.purge.old)
            if f_chain:
                fault("purge")
                tree.pins.release_under(set(tree.subtree_nodes(f_chain[0])))
                purged = tree.purge_subtree(f_parent, f_chain[0])
        elif plan.in_place and (chain or tree.single_chain_below(last_node)):
            extension = tree.single_chain_below(last_node)  # what eviction left of it
            if extension is None:
                raise SpliceError(500, "internal: the chain below the sequence changed")
            chain = chain + extension
            fault("detach")
            mine = ledger.take(tree.detach_chain(parent, chain))
            tail = plan.tail or Rotate(range(cached, cached), 0, in_place=True)
            keep = torch.zeros(int(mine.numel()), dtype=torch.bool)
            keep[tail.old.start - first : tail.old.stop - first] = True
            dropped = mine[~keep]
            fault("rotate_tail")
            with timer("rotate_tail"):
                slots = old_slots[tail.old.start : tail.old.stop]
                self._rotate(slots, slots, tail.old, tail.delta)
        fault("insert")
        target = req.target
        ns_key = lora_key(target.extra_key, self.lora_id)
        new_key = RadixKey(array("q", plan.new_tokens), ns_key, cache_salt=target.cache_salt)
        result = tree.insert(InsertParams(key=new_key, value=new_slots))
        self.allocated = sum(int(t.numel()) for t in ledger.fresh)
        ledger.release_to_tree()  # the tree owns new_slots now (duplicates freed just below)
        # what the target already held is freed: past the kept prefix, or (copied) from 0
        own_from = 0 if req.crosses else first
        dup = new_slots[own_from : max(own_from, int(result.prefix_len))]
        self.duplicates = int(dup.numel())  # what the target already held (a fork's rerun)
        self.freed = 0
        partial = new_slots[len(plan.new_tokens) // tree.page_size * tree.page_size :]
        for t in (dup, dropped, partial):  # partial: a paged tree holds full pages only
            if t is not None and t.numel():
                tree.token_to_kv_pool_allocator.free(t)
                self.freed += int(t.numel())
        return purged, bool(plan.in_place and chain)
