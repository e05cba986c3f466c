"""Versioned, idempotent splices (scheduler side): the ``expected_state`` check and the store of
answers an identical retry gets again.

A cached sequence version's id is ``wire.state_id`` (namespace and tokens; content-addressed, so
nothing is remembered to check it). A splice's ``idempotency_key`` is remembered with the digest
of its body (``SpliceRequest.digest``) and its 200 answer, per namespace, in a bounded LRU with a
TTL: a retry of the same body gets that answer (``replayed`` true) and nothing is applied again;
another body under the same key is a 409. A refused or failed splice changed nothing and is not
remembered (its retry runs). One store per scheduler (the scheduler is one thread; with
``--dp-size`` > 1 a namespace's splices all go to its home rank, ``dp.py``).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable

from leyline_agent.backends.sglang.errors import SpliceError
from leyline_agent.wire import SpliceRequest, state_id

MAX_KEYS = 4096
TTL_S = 3600.0


def check_expected_state(req: SpliceRequest) -> str:
    """The ``state_id`` of ``req.tokens`` (the parent version). 409 when ``req.expected_state``
    names another version: the client planned against a sequence it no longer sends."""
    parent = state_id(req.tokens, req.extra_key, req.cache_salt, req.lora_path)
    if req.expected_state is not None and req.expected_state != parent:
        raise SpliceError(
            409,
            f"stale state: the splice was planned against state {req.expected_state}, but the "
            f"tokens sent are state {parent}; re-read the session's tokens and plan again",
        )
    return parent


class ReplayStore:
    """``(namespace, idempotency_key) -> (body digest, answer JSON, time)``, at most
    ``max_keys`` entries (the oldest dropped first), each kept ``ttl_s`` seconds."""

    def __init__(
        self,
        max_keys: int = MAX_KEYS,
        ttl_s: float = TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_keys, self.ttl_s, self.clock = max_keys, ttl_s, clock
        self._entries: OrderedDict[
            tuple[str | None, str | None, str | None, str], tuple[str, str, float]
        ]
        self._entries = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _key(req: SpliceRequest) -> tuple[str | None, str | None, str | None, str]:
        assert req.idempotency_key is not None
        return (req.extra_key, req.cache_salt, req.lora_path, req.idempotency_key)

    def _expire(self) -> None:
        now = self.clock()
        while self._entries:
            _, (_, _, t) = next(iter(self._entries.items()))
            if now - t <= self.ttl_s:
                break
            self._entries.popitem(last=False)

    def replay(self, req: SpliceRequest) -> str | None:
        """The stored answer (``replayed`` set) to an identical earlier request, or None. 409
        when the key was used with another body."""
        if req.idempotency_key is None:
            return None
        self._expire()
        entry = self._entries.get(self._key(req))
        if entry is None:
            return None
        digest, body, t = entry
        if self.clock() - t > self.ttl_s:
            del self._entries[self._key(req)]
            return None
        if digest != req.digest():
            raise SpliceError(
                409,
                f"idempotency_key {req.idempotency_key!r} was used for another splice body "
                "(a retry must repeat the body exactly; a new edit needs a new key)",
            )
        return json.dumps({**json.loads(body), "replayed": True})

    def remember(self, req: SpliceRequest, body: str) -> None:
        """Keep the 200 answer ``body`` of ``req`` (no-op without a key)."""
        if req.idempotency_key is None:
            return
        self._entries[self._key(req)] = (req.digest(), body, self.clock())
        self._entries.move_to_end(self._key(req))
        while len(self._entries) > self.max_keys:
            self._entries.popitem(last=False)
