"""Scheduler-side execution of a splice (runs in SGLang's scheduler process, between batches).

Index regions of one AMORTIZE splice with directives ``d_0 < d_1 < ...`` over a cached sequence of
length ``L`` (old coordinates on the left, what the new sequence gets on the right)::

    [0, d_0.start)             prefix      -> tree-owned slots, reused as they are
    [d_i.start, d_i.end)       removed     -> dropped (freed when the tail is owned in place)
    replacement_i              new         -> prefilled through SGLang's extend path, attending
                                              to the new sequence before it
    [d_i.end, d_{i+1}.start)   middle      -> copied to fresh slots, k_pe δ-rotated by the
                                              cumulative delta (a later replacement attends to it)
    [d_last.end, L)            tail        -> δ-rotated in place when this path alone owns it,
                                              else copied first (copy-on-write)

FORGET from position ``f`` (the first FORGET directive): AMORTIZE directives before ``f`` are
spliced as above; everything of the new sequence from ``f`` on is re-prefilled, and every tree
node that held an old position ``>= f`` on this path (and its subtree) is purged.

Everything fallible (validation, matching, allocation, the forward passes) happens before the first
destructive step (detach, purge, in-place rotation); a failure frees what the splice allocated and
releases its lock, so the tree is as before.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from pydantic import ValidationError

from leyline_agent.backends.sglang.protocol import SpliceRequest, SpliceResponse
from leyline_agent.backends.sglang.radix import LeylineRadixCache
from leyline_agent.directive import DirectiveError, Mode, plan_edit, sort_and_check

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler import Scheduler

logger = logging.getLogger(__name__)


class SpliceError(Exception):
    """A splice that cannot run; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class _Owned:
    """Slots allocated by this splice (freed on failure)."""

    tensors: list[torch.Tensor] = field(default_factory=list)

    def add(self, t: torch.Tensor) -> torch.Tensor:
        self.tensors.append(t)
        return t


class SpliceExecutor:
    """Executes ``SpliceRequest`` payloads against one scheduler's tree and KV pool."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self._rope: tuple[Any, Any] | None = None

    # ---- entry point -------------------------------------------------------------------------
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
        except Exception as e:  # never take the scheduler down; the splice rolled back
            logger.exception("leyline splice failed")
            return 500, json.dumps({"error": f"splice failed and was rolled back: {e!r}"})
        return 200, resp.model_dump_json()

    def inspect(self, payload: str) -> tuple[int, str]:
        """``stats`` always; ``rows`` / ``tree_slots`` only with ``LEYLINE_DEBUG_ENDPOINTS=1``."""
        try:
            req = json.loads(payload)
            op = req.get("op")
            if op == "stats":
                return 200, json.dumps(self.stats())
            if os.environ.get("LEYLINE_DEBUG_ENDPOINTS") != "1":
                return 403, json.dumps({"error": "debug endpoints are disabled"})
            if op == "rows":
                return 200, json.dumps(self.rows(req["tokens"], req.get("extra_key")))
            if op == "tree_slots":
                return 200, json.dumps({"slots": self.tree.all_slots().tolist()})
            return 400, json.dumps({"error": f"unknown op {op!r}"})
        except Exception as e:
            logger.exception("leyline inspect failed")
            return 500, json.dumps({"error": repr(e)})

    def rows(self, tokens: list[int], extra_key: str | None) -> dict[str, Any]:
        """Cached length, slots and per-layer KV rows (values as fp32, and raw bit patterns)."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        tree = self.tree
        m = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens), extra_key)))
        n = int(m.device_prefix_len)
        slots = tree.path_device_indices(m.last_device_node)[:n].to(torch.int64)
        bufs = self._kv_buffers()
        int_view = {2: torch.int16, 4: torch.int32}
        values, bits = [], []
        for buf in bufs:
            rows = buf[slots][:, 0, :]
            values.append(rows.float().tolist())
            bits.append(rows.contiguous().view(int_view[rows.element_size()]).tolist())
        return {
            "cached": n,
            "slots": slots.tolist(),
            "dtype": str(bufs[0].dtype),
            "values": values,
            "bits": bits,
        }

    def stats(self) -> dict[str, Any]:
        """Allocator/tree counters; ``ok`` checks free + cached + in use == total when idle."""
        s = self.scheduler
        idle = s.running_batch.is_empty() and len(s.waiting_queue) == 0
        tree = s.tree_cache
        if not isinstance(tree, LeylineRadixCache):
            return {"error": f"radix cache is {type(tree).__name__}, not leyline"}
        out: dict[str, Any] = dict(tree.check_integrity(in_use=0))
        out["idle"] = idle
        if not idle:
            out["in_use"] = out["total"] - out["free"] - out["cached"]
            out["ok"] = None
        return out

    # ---- helpers -----------------------------------------------------------------------------
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

    def _kv_buffers(self) -> list[torch.Tensor]:
        pool = self.scheduler.token_to_kv_pool_allocator.get_kvcache()
        bufs = getattr(pool, "kv_buffer", None)
        if bufs is None:
            raise SpliceError(501, f"KV pool {type(pool).__name__} is not an MLA pool")
        return list(bufs)

    def _rope_spec(self) -> tuple[Any, Any]:
        if self._rope is None:
            from leyline_agent.kernels.rope import RopeSpec, mla_band

            cfg = self.scheduler.model_config.hf_config.to_dict()
            self._rope = (RopeSpec.from_hf_config(cfg), mla_band(cfg))
        return self._rope

    def _alloc(self, n: int, owned: _Owned) -> torch.Tensor:
        from sglang.srt.mem_cache.allocation import alloc_token_slots

        if n == 0:
            return torch.empty((0,), dtype=torch.int64, device=self.tree.device)
        try:
            slots = alloc_token_slots(self.tree, n)
        except Exception as e:  # SGLang raises RuntimeError on exhaustion
            raise SpliceError(503, f"KV pool exhausted: cannot allocate {n} slots ({e})") from e
        if slots is None:
            raise SpliceError(503, f"KV pool exhausted: cannot allocate {n} slots")
        return owned.add(slots.to(torch.int64))

    def _rotate(self, src: torch.Tensor, dst: torch.Tensor, old: range, delta: int) -> None:
        from leyline_agent.kernels.delta_rotation import delta_rotate

        if src.numel() == 0:
            return
        spec, band = self._rope_spec()
        dev = src.device
        old_pos = torch.arange(old.start, old.stop, dtype=torch.int64, device=dev)
        delta_rotate(self._kv_buffers(), src, dst, old_pos, old_pos + delta, spec, band)

    def _prefill(
        self, tokens: list[int], prefix: torch.Tensor, extra_key: str | None
    ) -> torch.Tensor:
        """Run ``tokens[len(prefix):]`` through SGLang's extend path with ``prefix`` (slot indices)
        as the cached context. Returns the new tokens' slots (the caller owns them)."""
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.sampling.sampling_params import SamplingParams

        s = self.scheduler
        n_prefix = int(prefix.numel())
        if len(tokens) <= n_prefix:
            return prefix.new_empty((0,))
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        params.normalize(None)
        req = Req(
            f"leyline-splice-{uuid.uuid4().hex}",
            "",
            array("q", tokens),
            params,
            extra_key=extra_key,
            vocab_size=s.model_config.vocab_size,
        )
        req.leyline_prefix = prefix
        req.refresh_fill_ids()
        req.prefix_len = n_prefix
        req.last_node = self.tree.root_node
        req.kv.cache_protected_len = n_prefix
        req.extend_end = len(tokens)
        batch = ScheduleBatch.init_new(
            [req],
            s.req_to_token_pool,
            s.token_to_kv_pool_allocator,
            self.tree,
            s.model_config,
            False,
            s.spec_algorithm,
        )
        try:
            batch.prepare_for_extend()
        except Exception:
            if req.kv.holds_kv:
                s.req_to_token_pool.free(req)
                req.kv.mark_kv_released()
            raise
        try:
            s.run_batch(batch)
        except Exception:
            s.token_to_kv_pool_allocator.free(batch.out_cache_loc)
            s.req_to_token_pool.free(req)
            req.kv.mark_kv_released()
            raise
        row = s.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        slots = row[n_prefix : len(tokens)].to(torch.int64).clone()
        s.req_to_token_pool.free(req)
        req.kv.mark_kv_released()
        return slots

    # ---- the splice --------------------------------------------------------------------------
    def splice(self, req: SpliceRequest) -> SpliceResponse:
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        t0 = time.perf_counter()
        tree = self.tree
        vocab = self.scheduler.model_config.vocab_size
        for name, ids in [("tokens", req.tokens)] + [
            (f"directives[{i}].replacement", d.replacement) for i, d in enumerate(req.directives)
        ]:
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise SpliceError(400, f"{name}: token ids out of range [0, {vocab}): {bad[:5]}")
        ordered = sort_and_check(req.directives, len(req.tokens))

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
        old_tokens = req.tokens[:cached]
        old_slots = tree.path_device_indices(last_node)[:cached].to(torch.int64)

        forget_at = min((d.start for d in ordered if d.mode is Mode.FORGET), default=None)
        amortized = [d for d in ordered if forget_at is None or d.start < forget_at]
        first = ordered[0].start
        plan = plan_edit(old_tokens, ordered)
        new_tokens = plan.new_tokens

        needed = sum(len(d.replacement) for d in amortized) + (cached - first)
        if forget_at is not None:
            needed += len(new_tokens)
        room = int(tree.token_to_kv_pool_allocator.available_size()) + int(tree.evictable_size())
        if needed > room:
            raise SpliceError(
                503, f"KV pool too small for this splice: needs up to {needed} slots, {room} free"
            )
        fail_after_prefill = bool(getattr(req, "debug_fail_after_prefill", False)) and (
            os.environ.get("LEYLINE_DEBUG_ENDPOINTS") == "1"
        )

        tree.inc_lock_ref(last_node)
        locked = True
        owned = _Owned()
        try:
            parent, chain = tree.chain_from(last_node, first)
            # Tokens cached past `tokens` on a single unshared branch (typically the previous
            # turn's generated reply) are not part of the sequence: an in-place splice drops them.
            extension = tree.single_chain_below(last_node)
            in_place = extension is not None and tree.chain_is_exclusive(
                chain + extension, own_locks=1
            )
            if in_place:
                chain = chain + extension
            if forget_at is not None:
                f_parent, f_chain = tree.chain_from(last_node, forget_at)
                if f_chain and any(
                    n.lock_ref > (1 if n in chain or n is last_node else 0)
                    for n in tree.subtree_nodes(f_chain[0])
                ):
                    raise SpliceError(
                        409, "FORGET: a running request still uses the span to purge; retry"
                    )

            # -- phase 1: everything fallible, nothing destructive --------------------------------
            new_parts: list[torch.Tensor] = [old_slots[:first]]
            prefilled = rotated = copied = 0
            acc = 0
            for i, d in enumerate(amortized):
                prefix = torch.cat(new_parts)
                upto = int(prefix.numel()) + len(d.replacement)
                if d.replacement:
                    repl = owned.add(self._prefill(new_tokens[:upto], prefix, req.extra_key))
                    new_parts.append(repl)
                    prefilled += len(d.replacement)
                acc += d.delta
                seg_end = amortized[i + 1].start if i + 1 < len(amortized) else cached
                if forget_at is not None:
                    seg_end = min(seg_end, forget_at)
                seg = old_slots[d.end : seg_end]
                is_tail = i + 1 == len(amortized) and forget_at is None
                if seg.numel() == 0:
                    continue
                if is_tail and in_place:
                    new_parts.append(seg)  # rotated in phase 2
                else:
                    dst = self._alloc(int(seg.numel()), owned)
                    self._rotate(seg, dst, range(d.end, seg_end), acc)
                    new_parts.append(dst)
                    copied += int(seg.numel())
                rotated += int(seg.numel())
            if forget_at is not None:
                # AMORTIZE directives before forget_at leave the kept span up to it in new_parts
                # (its tail was bounded by forget_at above); when none come before, the prefix
                # reaches exactly forget_at.
                prefix = torch.cat(new_parts)
                tail_slots = self._prefill(new_tokens, prefix, req.extra_key)
                owned.add(tail_slots)
                new_parts.append(tail_slots)
                prefilled += int(tail_slots.numel())
            new_slots = torch.cat(new_parts)
            if new_slots.numel() != len(new_tokens):
                raise SpliceError(500, "internal: slot plan does not cover the new sequence")

            if fail_after_prefill:
                raise RuntimeError(
                    "injected fault after phase 1 (LEYLINE_DEBUG_ENDPOINTS test hook)"
                )

            # -- phase 2: commit -----------------------------------------------------------------
            tree.dec_lock_ref(last_node)
            locked = False
            purged = 0
            if forget_at is not None:
                f_parent, f_chain = tree.chain_from(last_node, forget_at)
                if f_chain:
                    purged = tree.purge_subtree(f_parent, f_chain[0])
            if in_place and chain and forget_at is None:
                # mine == old_slots[first:cached] + the dropped extension's slots
                mine = tree.detach_chain(parent, chain)
                last = amortized[-1]
                keep = torch.zeros(int(mine.numel()), dtype=torch.bool)
                keep[last.end - first : cached - first] = True
                dropped = mine[~keep]
                tail = old_slots[last.end : cached]
                self._rotate(tail, tail, range(last.end, cached), acc)
                if dropped.numel():
                    tree.token_to_kv_pool_allocator.free(dropped)
            elif in_place and chain and forget_at is not None:
                in_place = False  # the chain from `first` up to forget_at stays for other users
            new_key = RadixKey(array("q", new_tokens), req.extra_key, cache_salt=req.cache_salt)
            result = tree.insert(InsertParams(key=new_key, value=new_slots))
            dup = new_slots[first : max(first, int(result.prefix_len))]
            if dup.numel():
                tree.token_to_kv_pool_allocator.free(dup)
            owned.tensors.clear()
        except BaseException:
            for t in owned.tensors:
                tree.token_to_kv_pool_allocator.free(t)
            if locked:
                tree.dec_lock_ref(last_node)
            raise
        return SpliceResponse(
            new_length=len(new_tokens),
            prefix_reused=first,
            prefilled=prefilled,
            rotated=rotated,
            copied=copied,
            purged=purged,
            in_place=bool(in_place and chain),
            elapsed_ms=(time.perf_counter() - t0) * 1e3,
            cached_before=cached,
        )
