"""The Leyline general plugin for SGLang (entry-point group ``sglang.srt.plugins``).

SGLang's ``load_plugins()`` calls :func:`register` in every SGLang process (HTTP server, scheduler,
detokenizer), then applies the hooks. Each hook is small and named for what it changes:

- ``register_radix_backend``: ``--radix-cache-backend leyline`` (``radix.LeylineRadixCache``).
- ``register_attention_backend``: ``--attention-backend leyline_cpu`` (``attention.py``; the name
  joins the argparse choices, which ``launch_server`` parses after ``load_plugins()``).
- ``add_splice_dispatch`` (AFTER ``Scheduler.init_request_dispatcher``): the scheduler answers
  ``SpliceReqInput`` (splice, fork, pin, unpin) / ``InspectReqInput`` between batches.
- ``expire_pins`` (BEFORE ``Scheduler.get_next_batch_to_run``): pins past their TTL are released
  at the top of every scheduler iteration (``pins.py``).
- ``pin_to_dp_rank`` (BEFORE ``TokenizerManager.generate_request``): with ``--dp-size`` > 1 a
  request with a cache namespace goes to that namespace's home DP rank (``dp.py``).
- ``add_communicators``: the tokenizer manager gets ``leyline_splice_communicator`` and
  ``leyline_inspect_communicator`` (``_COMMUNICATOR_SPECS``, read when it is built);
  ``mux.install`` (AFTER ``TokenizerManager.init_communicators``) makes each a ``RidMux``: any
  number in flight, replies matched by ``rid`` (SGLang's own queue one at a time).
- ``add_http_routes`` (main process only): ``POST /leyline/splice``, ``/leyline/fork``,
  ``/leyline/pin``, ``/leyline/unpin``, ``GET /leyline/stats``, and
  with ``LEYLINE_DEBUG_ENDPOINTS=1`` ``POST /leyline/debug/inspect`` (KV rows, for tests).
- ``cpu_dev.apply`` when ``LEYLINE_CPU_DEV=1``.

Route: the same as SGLang's own control requests (``/flush_cache``): HTTP handler -> tokenizer
manager communicator -> ZMQ -> scheduler dispatcher -> handler -> reply.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Callable
from typing import Any

from leyline_agent.backends.sglang import cpu_dev

logger = logging.getLogger(__name__)


def register() -> None:
    """Plugin entry point. Safe to call more than once per process."""
    if cpu_dev.enabled():
        cpu_dev.apply()
    register_radix_backend()
    register_attention_backend()
    register_io_types()
    add_communicators()
    from leyline_agent.backends.sglang.compat import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.init_request_dispatcher",
        add_splice_dispatch,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
        expire_pins,
        HookType.BEFORE,
    )
    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
        pin_to_dp_rank,
        HookType.BEFORE,
    )
    from leyline_agent.backends.sglang.mux import install

    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.init_communicators",
        install,
        HookType.AFTER,
    )
    if multiprocessing.parent_process() is None:
        add_http_routes()


def register_radix_backend() -> None:
    from leyline_agent.backends.sglang.compat import (
        register_radix_cache_backend,
        registered_radix_cache_backends,
    )
    from leyline_agent.backends.sglang.radix import BACKEND_NAME, leyline_radix_cache_factory

    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, leyline_radix_cache_factory)


def register_attention_backend() -> None:
    from leyline_agent.backends.sglang.attention import register_backend

    register_backend()


def register_io_types() -> None:
    from leyline_agent.backends.sglang import ipc as p
    from leyline_agent.backends.sglang.compat import hook_custom_types

    hook_custom_types(p.SpliceReqInput, p.SpliceReqOutput, p.InspectReqInput, p.InspectReqOutput)


def add_communicators() -> None:
    from leyline_agent.backends.sglang import ipc as p
    from leyline_agent.backends.sglang.compat import tokenizer_control_mixin as tcm

    names = {spec[0] for spec in tcm._COMMUNICATOR_SPECS}
    for name, out_type in [
        ("leyline_splice", p.SpliceReqOutput),
        ("leyline_inspect", p.InspectReqOutput),
    ]:
        if name not in names:
            tcm._COMMUNICATOR_SPECS.append((name, out_type))


def pin_to_dp_rank(tm: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook: a generate/chat request in a cache namespace (``extra_key``/``cache_salt``)
    that names no DP rank itself goes to the namespace's home rank (``dp.home_rank``), where its
    splices run too. A no-op with one DP rank, for batches of namespaces, and without one."""
    from leyline_agent.backends.sglang.dp import home_rank

    obj = args[0] if args else kwargs.get("obj")
    if obj is None or not hasattr(obj, "routed_dp_rank"):
        return None
    if obj.routed_dp_rank is not None or getattr(obj, "data_parallel_rank", None) is not None:
        return None
    extra_key, salt = getattr(obj, "extra_key", None), getattr(obj, "cache_salt", None)
    if not all(v is None or isinstance(v, str) for v in (extra_key, salt)):
        return None
    rank = home_rank(extra_key, salt, int(getattr(tm, "elastic_worker_count", 1) or 1))
    if rank is not None:
        obj.routed_dp_rank = rank
    return None


def expire_pins(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook, every scheduler iteration: release the pins whose TTL has passed, so that
    admission control sees their room (``pins.py``)."""
    pins = getattr(scheduler.tree_cache, "pins", None)
    if pins is not None:
        pins.expire()


def add_splice_dispatch(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook: route Leyline control requests to this scheduler's executor."""
    from leyline_agent.backends.sglang import ipc as p
    from leyline_agent.backends.sglang.compat import TypeBasedDispatcher, get_parallel
    from leyline_agent.backends.sglang.dp import NOT_MINE, pin_prefix
    from leyline_agent.backends.sglang.inspect import handle_inspect
    from leyline_agent.backends.sglang.splice import SpliceExecutor

    executor = SpliceExecutor(scheduler)
    try:  # every TP rank of a DP rank runs the same request
        me = int(get_parallel().dp_rank or 0)
    except (RuntimeError, ValueError):  # not published: outside a server (tests), no DP
        me = 0
    pins = getattr(scheduler.tree_cache, "pins", None)
    if pins is not None:
        pins.prefix = pin_prefix(me)  # pin ids name their DP rank (routes.unpin routes by it)

    def on_splice(req: p.SpliceReqInput) -> p.SpliceReqOutput:
        if req.dp_rank is not None and req.dp_rank != me:
            return p.SpliceReqOutput(status=NOT_MINE, body="{}", dp_rank=me, rid=req.rid)
        status, body = executor.handle(req.payload, getattr(req, "op", "splice"))
        return p.SpliceReqOutput(status=status, body=body, dp_rank=me, rid=req.rid)

    def on_inspect(req: p.InspectReqInput) -> p.InspectReqOutput:
        if req.dp_rank is not None and req.dp_rank != me:
            return p.InspectReqOutput(status=NOT_MINE, body="{}", dp_rank=me, rid=req.rid)
        status, body = handle_inspect(executor.served, req.payload)
        return p.InspectReqOutput(status=status, body=body, dp_rank=me, rid=req.rid)

    handlers: list[tuple[type, Callable[..., Any]]] = [
        (p.SpliceReqInput, on_splice),
        (p.InspectReqInput, on_inspect),
    ]
    scheduler._request_dispatcher += TypeBasedDispatcher(handlers)
    return result


def add_http_routes() -> None:
    from leyline_agent.backends.sglang.routes import add_routes

    add_routes()
