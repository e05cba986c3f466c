"""What a splice checks before its first lock or allocation, and the refusals it answers with.

``Served`` resolves, once per scheduler, what the server must offer for a splice (the Leyline
radix cache (any page size: ``paged_plan.py``), a KV pool ``kv_layout`` knows, a RoPE ``served_rope`` can reproduce)
and checks each request's token ids; ``check_forget_span`` and ``check_capacity`` run under the
splice's lock. Every refusal is a :class:`SpliceError` (``errors.py``) carrying its HTTP status
and changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from leyline_agent.backends.sglang.errors import SpliceError
from leyline_agent.backends.sglang.kv_layout import (
    KVLayout,
    UnsupportedKV,
    check_full_attention,
    kv_layout,
)
from leyline_agent.backends.sglang.radix import LeylineRadixCache
from leyline_agent.backends.sglang.served_rope import served_model, served_rope
from leyline_agent.kernels.rope import RopeBand, RopeSpec
from leyline_agent.wire import PinRequest, SpliceRequest

if TYPE_CHECKING:
    from leyline_agent.backends.sglang.compat import Scheduler, TreeNode
    from leyline_agent.backends.sglang.ledger import Ledger


class Served:
    """One scheduler's tree, KV layout and RoPE, resolved on first use (501 when unsupported)."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self._layout: KVLayout | None = None
        self._rope: tuple[RopeSpec, RopeBand, str] | None = None

    @property
    def tree(self) -> LeylineRadixCache:
        tree = self.scheduler.tree_cache
        if not isinstance(tree, LeylineRadixCache):
            raise SpliceError(
                501,
                f"the server's radix cache is {type(tree).__name__}; splices need "
                "'--radix-cache-backend leyline' (leyline serve sets it)",
            )
        return tree

    def kv_buffers(self) -> KVLayout:
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

    def rope_spec(self) -> tuple[RopeSpec, RopeBand, str]:
        """The served model's RoPE (``served_rope``: its rotary modules, else the config), the
        band it occupies in a cache row, and the source ("model" or "config")."""
        if self._rope is None:
            layout = self.kv_buffers()
            cfg = self.scheduler.model_config.hf_config.to_dict()
            try:
                spec, source = served_rope(served_model(self.scheduler), cfg)
                band = layout.band(spec)
            except (ValueError, KeyError, TypeError) as e:
                raise SpliceError(501, f"splices are not supported on this model: {e}") from e
            self._rope = (spec, band, source)
        return self._rope

    def check(self, req: SpliceRequest) -> LeylineRadixCache:
        """The server's settings (``check_settings``: 501), everything above, the request's token
        ids (400) and a free request row (503)."""
        check_settings(self.scheduler)
        tree = self.tree
        self.kv_buffers()
        self.rope_spec()
        self.check_tokens(req.tokens)
        for i, d in enumerate(req.directives):
            self.check_tokens(d.replacement, f"directives[{i}].replacement")
        if self.scheduler.req_to_token_pool.available_size() < 1:
            raise SpliceError(503, "no free request slot for the replacement prefill; retry")
        return tree

    def check_tokens(self, ids: Sequence[int], name: str = "tokens") -> None:
        """400 for token ids outside the vocabulary (they would crash SGLang's scheduler)."""
        vocab = self.scheduler.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise SpliceError(400, f"{name}: token ids out of range [0, {vocab}): {bad[:5]}")


def check_cached(req: SpliceRequest | PinRequest, cached: int, op: str = "splice") -> None:
    """409 unless all of ``req.tokens`` is cached in the request's namespace."""
    if cached < len(req.tokens):
        advice = {
            "splice": "send the full request instead (it will be prefilled)",
            "fork": "send the child's first request in full instead (it will be prefilled)",
            "pin": "pin what a request has cached (its prompt, or a prefix of it)",
        }[op]
        raise SpliceError(
            409,
            f"sequence not cached in namespace extra_key={req.extra_key!r}"
            f"{f', cache_salt={req.cache_salt!r}' if req.cache_salt else ''}: only {cached} of "
            f"{len(req.tokens)} tokens are cached (evicted, flushed, or never sent); {advice}",
        )


def check_forget_span(
    tree: LeylineRadixCache, last_node: TreeNode, forget_at: int, ledger: Ledger
) -> None:
    """409 while a running request (a lock other than the splice's own or a pin's, which the
    FORGET releases) holds the span FORGET would purge."""
    _, f_chain = tree.chain_from(last_node, forget_at)
    if not f_chain:
        return
    ours = ledger.locked_path()
    nodes = tree.subtree_nodes(f_chain[0])
    if any(n.lock_ref > (1 if n in ours else 0) + tree.pins.locks_on(n) for n in nodes):
        raise SpliceError(409, "FORGET: a running request still uses the span to purge; retry")


def check_capacity(tree: LeylineRadixCache, needed: int) -> None:
    """503 unless ``needed`` fits in free slots plus unlocked tree nodes (the splice's path is
    locked)."""
    room = int(tree.token_to_kv_pool_allocator.available_size()) + int(tree.evictable_size())
    if needed > room:
        raise SpliceError(
            503,
            f"KV pool too small for this splice: needs {needed} slots, {room} free or "
            "evictable (the rest is in use or locked); retry later or send the full request",
        )


def check_context_length(scheduler: Scheduler, old_len: int, new_len: int) -> None:
    """400 (in SGLang's error format) when a splice would grow a sequence to ``new_len`` tokens
    that no request could then send: SGLang's scheduler refuses an input of
    ``max_req_input_len`` tokens or more (``--context-length`` - 6 by default: ``tp_worker.py``),
    so the next request on it would get 400 (and a FORGET past it would fail its prefill).
    Before any lock or allocation; a splice that does not grow the sequence (or a fork, which
    copies it) is never refused here."""
    limit = int(getattr(scheduler, "max_req_input_len", 0) or 0)
    if limit <= 0 or new_len <= old_len or new_len < limit:
        return
    context = int(scheduler.model_config.context_len)
    raise SpliceError(
        400,
        f"The spliced sequence ({new_len} tokens, from {old_len}) would be longer than the "
        f"server's maximum input length ({limit - 1} tokens; the model's context length is "
        f"{context} tokens): no request could send it. Remove more tokens, replace fewer, or "
        "send the request in full.",
        error_type="invalid_request_error",
    )


def check_settings(scheduler: Scheduler) -> None:
    """501 on server settings a splice (or fork) cannot be made right on, before any change:

    - ``--enable-hierarchical-cache`` (HiCache): pages written back to host memory and L3
      storage are keyed by their tokens only; a spliced page (rotated, or prefilled against an
      edited context) written back would be served to other sessions as the exact KV of those
      tokens. ``leyline serve`` then runs SGLang's own HiCache radix tree (``radix.py``).
    - (``--enable-lora`` is not refused here: a splice names its adapter, ``lora.py``.)
    - speculative decoding (EAGLE, EAGLE3, MTP, standalone drafts): the draft model's KV pool
      shares the target's slot indices; a splice would need the same remap, copies and RoPE
      rotation there (and the draft's own RoPE), which the plugin does not do.
    """
    if getattr(scheduler, "enable_hierarchical_cache", False):
        raise SpliceError(
            501,
            "splices are refused with --enable-hierarchical-cache: HiCache keys the pages it "
            "writes back to host memory and storage by their tokens only, so a spliced page "
            "would be served to other sessions as exact KV (docs/backend.md)",
        )
    spec = getattr(scheduler, "spec_algorithm", None)
    if spec is not None and not spec.is_none():
        raise SpliceError(
            501,
            f"splices are refused with speculative decoding ({getattr(spec, 'name', spec)}): the "
            "draft model's KV pool shares the slot indices and would need the same remap and "
            "rotation (docs/backend.md)",
        )
