"""Splices under a LoRA adapter (``--enable-lora``): the adapter's radix namespace and its prefill.

SGLang serves an adapter's requests in their own radix namespace: the tokenizer manager resolves a
request's ``lora_path`` (the adapter's name: ``--lora-paths NAME=DIR``, ``/load_lora_adapter``, or
the OpenAI routes' ``model: "BASE:NAME"`` / ``lora_path``) to the adapter's ``lora_id``, and
``Req.__init__`` keys the request by ``(extra_key or "") + lora_id`` (``managers/
schedule_batch.py``), so KV computed with one adapter is never read by another or by the base model.

A splice names its adapter the same way (``SpliceRequest.lora_path``). :func:`resolve` maps the name
to the ``lora_id`` in the scheduler (the LoRA manager's ``lora_refs``: the adapters loaded now);
:func:`lora_key` builds the namespace key every tree match and insert of the splice uses; the
replacement prefill and FORGET's re-prefill pass the ``lora_id`` to their ``Req``
(``prefill.prefill_tokens``), so ``ScheduleBatch``/``ForwardBatch`` carry it in ``lora_ids`` and
``ForwardBatch.init_new`` has the LoRA manager load and prepare the adapter for the batch
(``fetch_new_loras``, ``prepare_lora_batch``), exactly as for SGLang's own extend batches.

Refused before any change (``SpliceError``): ``lora_path`` on a server without ``--enable-lora``
(400, as SGLang answers such a request); a name the scheduler has not loaded (400: never loaded,
or unloaded since; a request naming it reloads it, then the splice can run); an adapter that cannot
join the running batch's adapters now (503, ``LoRAManager.validate_lora_batch``: more than
``--max-loras-per-batch`` would evict one a running request uses; retry).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from leyline_agent.backends.sglang.errors import SpliceError

if TYPE_CHECKING:
    from leyline_agent.backends.sglang.compat import Scheduler


def lora_manager(s: Scheduler) -> Any:
    """The scheduler's ``LoRAManager`` (``tp_worker.model_runner.lora_manager``), or None."""
    runner = getattr(getattr(s, "tp_worker", None), "model_runner", None)
    return getattr(runner, "lora_manager", None)


def resolve(s: Scheduler, lora_path: str | None) -> str | None:
    """The ``lora_id`` (hex str) of adapter ``lora_path``; None for the base model (no adapter).

    Raises ``SpliceError`` 400 (LoRA not enabled, or no adapter of that name loaded) or 503 (the
    adapter cannot be loaded beside the running batch's adapters now). Changes nothing.
    """
    if lora_path is None:
        return None
    manager = lora_manager(s)
    if not getattr(s, "enable_lora", False) or manager is None:
        raise SpliceError(
            400,
            f"LoRA adapter {lora_path!r} was named, but LoRA is not enabled on this server "
            "(launch it with --enable-lora --lora-paths NAME=DIR)",
            error_type="invalid_request_error",
        )
    refs = {ref.lora_name: ref.lora_id for ref in manager.lora_refs.values()}
    if lora_path not in refs:
        raise SpliceError(
            400,
            f"unknown LoRA adapter {lora_path!r}: the loaded adapters are {sorted(refs)} (an "
            "adapter unloaded since is reloaded by a request naming it; splice after that)",
            error_type="invalid_request_error",
        )
    lora_id = refs[lora_path]
    running = {r.lora_id for r in getattr(s.running_batch, "reqs", []) if not r.finished()}
    if not manager.validate_lora_batch(running | {lora_id}):
        raise SpliceError(
            503,
            f"LoRA adapter {lora_path!r} cannot be loaded beside the adapters running now "
            "(--max-loras-per-batch); retry",
        )
    return lora_id


def lora_key(extra_key: str | None, lora_id: str | None) -> str | None:
    """The radix-cache ``extra_key`` of a request with ``extra_key`` under adapter ``lora_id``:
    ``(extra_key or "") + lora_id`` as ``Req.__init__`` builds it; ``extra_key`` without one."""
    return extra_key if lora_id is None else (extra_key or "") + lora_id
