"""Many Leyline control requests in flight at once, replies matched by ``rid``.

SGLang's control communicators (``FanOutCommunicator`` in
``sglang/srt/managers/communicator.py``, mode ``queueing``) keep one request in flight: a second
caller waits until the first one's reply is back. The scheduler answers control requests between
batches, so under load each queued splice waited a whole batch step behind the one before it
(replay at C = 16 on SmolLM2: a splice call took 39.8 s on average against 576 ms at C = 1,
``docs/replay.md``). Generate requests do not queue that way: the tokenizer manager multiplexes
them by ``rid``. :class:`RidMux` does the same for Leyline's own requests: each gets a fresh
``rid``, every pending one is sent at once, the scheduler handles all that arrived in one pause
between batches (``Scheduler.process_input_requests``, in arrival order, so two edits of one
namespace still run one after the other) and copies the ``rid`` into its reply.

:func:`install` replaces ``tm.leyline_splice_communicator`` / ``tm.leyline_inspect_communicator``
with a ``RidMux`` over the same send function and fan-out (one reply per DP rank), and points
the tokenizer manager's result dispatcher at it (AFTER hook on ``init_communicators``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

logger = logging.getLogger(__name__)

NAMES = ("leyline_splice", "leyline_inspect")


class RidMux:
    """A drop-in for a ``FanOutCommunicator`` (``await mux(req)`` -> the list of replies, one per
    DP rank; ``set_fan_out``) that keeps any number of requests in flight.

    ``send``: the tokenizer manager's ``_dispatch_to_scheduler``; ``fan_out``: replies expected
    per request (DP ranks; ``set_fan_out`` changes it for later requests). A reply whose ``rid``
    names no waiting request (its caller was cancelled) is dropped with a debug log line.
    """

    def __init__(self, send: Any, fan_out: int) -> None:
        self._send = send
        self._fan_out = fan_out
        self._waiting: dict[str, tuple[int, list[Any], asyncio.Future[list[Any]]]] = {}
        self.requests = 0
        self.in_flight_max = 0

    def set_fan_out(self, fan_out: int) -> None:
        self._fan_out = fan_out

    @property
    def in_flight(self) -> int:
        return len(self._waiting)

    def figures(self) -> dict[str, int]:
        """``requests`` sent, ``in_flight`` now, ``in_flight_max`` since the server started
        (``/leyline/stats`` shows the splice communicator's as ``control``)."""
        return {
            "requests": self.requests,
            "in_flight": self.in_flight,
            "in_flight_max": self.in_flight_max,
        }

    async def __call__(self, obj: Any) -> list[Any]:
        rid = f"leyline-{uuid.uuid4().hex}"
        obj.rid = rid
        fut: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = (self._fan_out, [], fut)
        self.requests += 1
        self.in_flight_max = max(self.in_flight_max, len(self._waiting))
        try:
            self._send(obj)
            return await fut
        finally:
            self._waiting.pop(rid, None)

    def handle_recv(self, out: Any) -> None:
        entry = self._waiting.get(getattr(out, "rid", None) or "")
        if entry is None:
            logger.debug("dropping a Leyline reply with no waiting request: %r", out.rid)
            return
        fan_out, replies, fut = entry
        replies.append(out)
        if len(replies) >= fan_out and not fut.done():
            fut.set_result(replies)


def install(result: Any, tm: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook on ``TokenizerManager.init_communicators``: each Leyline communicator becomes a
    :class:`RidMux` over its send function and fan-out. Where the dispatcher is not the
    ``TypeBasedDispatcher`` this was written against (no ``_mapping``), the queueing
    communicators stay and a warning says so."""
    from leyline_agent.backends.sglang import ipc as p

    dispatcher: Any = getattr(tm, "_result_dispatcher", None)
    mapping = getattr(dispatcher, "_mapping", None)
    if not isinstance(mapping, dict):
        logger.warning("Leyline: SGLang's result dispatcher changed; control requests queue")
        return result
    for name, out_type in zip(NAMES, (p.SpliceReqOutput, p.InspectReqOutput), strict=True):
        comm = getattr(tm, f"{name}_communicator", None)
        if comm is None or isinstance(comm, RidMux):
            continue
        mux = RidMux(comm._send, comm._fan_out)
        mapping[out_type] = mux.handle_recv
        setattr(tm, f"{name}_communicator", mux)
    if hasattr(dispatcher, "_mro_cache"):
        dispatcher._mro_cache.clear()
    return result
