"""The replacement prefill: run new tokens through SGLang's own extend path, attending to a staged
prefix given as slot indices (which need not be a tree path).

A synthetic ``Req`` goes through ``ScheduleBatch.prepare_for_extend`` (allocates the request row
and the new tokens' slots; may evict unlocked tree nodes) and ``Scheduler.run_batch`` (the forward
pass writes the new tokens' KV). The prefix is staged on the tree for the request's ``rid``
(``LeylineRadixCache.stage_prefix``; its ``prefix_device_indices`` hands it to SGLang) and unstaged
whatever happens. On any failure, the request row and the new slots are freed before re-raising:
every slot the allocator hands out during ``prepare_for_extend`` is recorded as it is handed out
(``tracked_allocs``), so a failure between the allocation and SGLang's ``batch.out_cache_loc``
(e.g. ``write_cache_indices`` past the request row, a sequence longer than the context) frees them
too instead of leaking them (which SGLang's idle check answers by killing the server).

Only the KV is wanted, not a next token: the request is prefill-only (``max_new_tokens`` 0, so
SGLang samples nothing) and, for the duration of the forward, the model's LM head is skipped
(``no_logits``: the last position's logits over the whole vocabulary were most of a short
replacement's cost on CPU: 6 of 10 ms with the embedded model's 200k-token vocabulary).
"""

from __future__ import annotations

import uuid
from array import array
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from leyline_agent.backends.sglang.compat import Scheduler
    from leyline_agent.backends.sglang.radix import LeylineRadixCache


def prefill_tokens(
    s: Scheduler,
    tree: LeylineRadixCache,
    tokens: list[int],
    prefix: torch.Tensor,
    extra_key: str | None,
    cache_salt: str | None,
    fault: Callable[[str], None],
    lora_id: str | None = None,
) -> torch.Tensor:
    """Prefill ``tokens[len(prefix):]`` with ``prefix`` (int64 slot ids ``[P]``) as context.

    ``lora_id``: run the forward with that LoRA adapter (``lora.py``): the ``Req`` carries it, so
    ``ForwardBatch.init_new`` has SGLang's LoRA manager load and prepare it for the batch, as for
    any extend of that adapter's requests; None: the base model.

    Returns the new tokens' slots, int64 ``[len(tokens) - P]``; the caller owns them. ``fault`` is
    called at ``prefill.prepare`` and ``prefill.forward`` (test hook). Raises whatever SGLang
    raises (e.g. ``RuntimeError`` when the pool is exhausted); nothing is held then.
    """
    from leyline_agent.backends.sglang.compat import Req, SamplingParams, ScheduleBatch

    n_prefix = int(prefix.numel())
    if len(tokens) <= n_prefix:
        return prefix.new_empty((0,))
    params = SamplingParams(max_new_tokens=0, temperature=0.0)
    params.normalize(None)
    req = Req(
        f"leyline-splice-{uuid.uuid4().hex}",
        "",
        array("q", tokens),
        params,
        extra_key=extra_key,
        vocab_size=s.model_config.vocab_size,
        lora_id=lora_id,
    )
    req.cache_salt = cache_salt
    req.refresh_fill_ids()
    req.prefix_len = n_prefix
    req.last_node = tree.root_node
    req.kv.cache_protected_len = n_prefix
    req.extend_end = len(tokens)
    batch = ScheduleBatch.init_new(
        [req],
        s.req_to_token_pool,
        s.token_to_kv_pool_allocator,
        tree,
        s.model_config,
        False,
        s.spec_algorithm,
    )
    tree.stage_prefix(req.rid, prefix)
    allocator = s.token_to_kv_pool_allocator
    got: list[torch.Tensor] = []
    try:
        with tracked_allocs(allocator, got, fault):
            batch.prepare_for_extend()
        fault("prefill.prepare")
        fault("prefill.forward")
        with no_logits(s):
            s.run_batch(batch)
    except BaseException:
        for loc in got:  # batch.out_cache_loc among them, when SGLang got that far
            if loc.numel():
                allocator.free(loc)
        if req.kv.holds_kv:
            s.req_to_token_pool.free(req)
            req.kv.mark_kv_released()
        raise
    finally:
        tree.unstage_prefix(req.rid)
    row = s.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    slots = row[n_prefix : len(tokens)].to(torch.int64).clone()
    s.req_to_token_pool.free(req)
    req.kv.mark_kv_released()
    return slots


@contextmanager
def tracked_allocs(
    allocator: Any, got: list[torch.Tensor], fault: Callable[[str], None]
) -> Iterator[None]:
    """While inside, every tensor of slots ``allocator.alloc``/``alloc_extend`` hands out is
    appended to ``got`` (then ``fault("prefill.alloc")``: the test hook for a failure right after
    an allocation). Instance attributes, removed on exit (the scheduler is one thread)."""
    patched = []
    for name in ("alloc", "alloc_extend"):
        fn = getattr(allocator, name, None)
        if fn is None or name in vars(allocator):
            continue

        def recording(*args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
            out = _fn(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                got.append(out)
                fault("prefill.alloc")
            return out

        setattr(allocator, name, recording)
        patched.append(name)
    try:
        yield
    finally:
        for name in patched:
            delattr(allocator, name)


@contextmanager
def no_logits(s: Scheduler) -> Iterator[None]:
    """While inside, the served model's ``logits_processor`` returns one zero logit per row
    instead of projecting onto the vocabulary (a prefill-only batch samples nothing from them).
    An instance attribute, removed on exit; the scheduler runs one batch at a time. A model
    without a ``logits_processor`` runs unchanged."""
    model = getattr(getattr(getattr(s, "tp_worker", None), "model_runner", None), "model", None)
    proc = getattr(model, "logits_processor", None)
    if proc is None or not hasattr(proc, "_get_logits"):
        yield
        return

    def zero_logits(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        return hidden_states.new_zeros((hidden_states.shape[0], 1))

    proc._get_logits = zero_logits
    try:
        yield
    finally:
        del proc._get_logits
