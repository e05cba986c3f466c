"""The proxy's stored Responses-API responses: each one's conversation, so that a request with
``previous_response_id`` continues it (``openai_responses.py``). In memory, per tenant, bounded,
with an expiry."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]
DEFAULT_MAX_STORED = 4096
DEFAULT_STORED_TTL_S = 24 * 3600.0


@dataclass
class Stored:
    response: dict[str, Any]
    conversation: list[Message]  # the chat messages, the answer included (no instructions)
    expires: float


class ResponseStore:
    """Stored responses by ``(tenant, id)``: the least recently stored beyond ``max_entries`` is
    dropped, and each expires ``ttl_s`` seconds after it was stored (``clock``: seconds)."""

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_STORED,
        ttl_s: float = DEFAULT_STORED_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 1 or ttl_s <= 0:
            raise ValueError("max_entries must be >= 1 and ttl_s > 0")
        self.max_entries, self.ttl_s, self._clock = max_entries, ttl_s, clock
        self._items: OrderedDict[tuple[str, str], Stored] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, tenant: str, response: dict[str, Any], conversation: list[Message]) -> None:
        with self._lock:
            key = (tenant, response["id"])
            self._items[key] = Stored(response, conversation, self._clock() + self.ttl_s)
            self._items.move_to_end(key)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)

    def get(self, tenant: str, response_id: str) -> Stored | None:
        """The stored response, or None: unknown, deleted, expired, or another tenant's."""
        with self._lock:
            found = self._items.get((tenant, response_id))
            if found is not None and found.expires <= self._clock():
                del self._items[(tenant, response_id)]
                return None
            return found

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            return self._items.pop((tenant, response_id), None) is not None

    def __len__(self) -> int:
        return len(self._items)
