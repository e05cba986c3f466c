"""One conversation behind the proxy (``ProxySession``): its key, core, lock, backend, pin
state and the JSON views ``/leyline/sessions`` shows; ``sessions.py`` keeps the registry of them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from leyline_agent.accounting import Totals
from leyline_agent.proxy.identity import SessionKey, match_form, size
from leyline_agent.session import SessionCore

Source = Literal["header", "cache_key", "user", "prefix", "new"]

# What the less obvious counters mean, shown beside them (``GET /leyline/sessions``, ``notes``).
FIELD_NOTES = {
    "saved_tokens": "reprefill_tokens - prefilled_tokens: what the splices saved; "
    "reprefill_tokens: on a spliced turn the prompt minus the longest prefix of it the backend "
    "held unchanged before the splice, on other turns the tokens prefilled",
    "best_hit_rate": "best_reused_tokens / prompt_tokens, an upper bound: a turn in the shared "
    "namespace (shared_turns: before the session's first splice) counts its whole prompt, since "
    "any session may have cached it; a gap there is a loose bound, not cache lost",
}


class PinError(NamedTuple):
    """The session's last pin attempt, refused: the turn it followed, the backend's status
    (429 the server's cap, 409 not cached, 0 unreachable, ...), ``SpliceRejected.reason``
    (``pin_cap``, ``not_cached``, ...) and its message."""

    turn: int
    status: int
    reason: str
    message: str


@dataclass
class ProxySession:
    """One conversation behind the proxy."""

    key: SessionKey
    core: SessionCore
    source: Source
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    warned: bool = False  # logged that the backend's prompt differs from the rendered one
    backend: str | None = None  # the URL of the backend holding its KV (``backends.py``)
    forked_from: str | None = None  # the public id of the session it was forked from
    pin_error: PinError | None = None  # the last pin attempt, when it was refused
    requested: Sequence[Mapping[str, Any]] | None = None  # the messages of its latest request
    # the committed messages last seen by committed_form(), their match forms, cumulative sizes
    _seen: list[dict[str, Any]] | None = field(default=None, repr=False)
    _form: tuple[list[dict[str, Any]], list[int]] = field(
        default_factory=lambda: ([], []), repr=False
    )

    @property
    def id(self) -> str:
        return self.key.public_id

    @property
    def tenant(self) -> str:
        return self.key.tenant

    @property
    def named(self) -> bool:
        """Named by a key (header, ``prompt_cache_key``): never matched by its history."""
        return self.key.kind in ("header", "cache_key")

    @property
    def scope(self) -> str | None:
        """The ``user`` whose conversation this is (None: none; named or anonymous)."""
        return self.key.name if self.key.kind == "user" else None

    def committed_form(self) -> tuple[list[dict[str, Any]], list[int]]:
        """The committed messages' match forms and their cumulative sizes (characters of
        canonical JSON, a stand-in for rendered tokens); cached until the next commit."""
        if self._seen is not self.core.messages:
            forms = [match_form(m) for m in self.core.messages]
            sizes, total = [], 0
            for f in forms:
                total += size(f)
                sizes.append(total)
            self._seen, self._form = self.core.messages, (forms, sizes)
        return self._form

    def summary(self) -> dict[str, Any]:
        """Totals of the session (``GET /leyline/sessions``)."""
        return {
            "id": self.id,
            "tenant": self.tenant,
            "namespace": self.core.placement.own,
            "request_namespace": self.core.placement.extra_key,
            "private": self.core.placement.private,
            "forked_from": self.forked_from,
            "pin": self.pin(),
            "pins": self.pins(),
            "pin_error": self.pin_error._asdict() if self.pin_error else None,
            "backend": self.backend,
            "source": self.source,
            "user": self.scope,
            "splice": self.core.splice_enabled,
            "created": self.created,
            "in_flight": self.lock.locked(),
            # the version the session's last splice made (wire.state_id), None before one
            "state_id": self.core.states[-1]["state_id"] if self.core.states else None,
            **Totals.of(self.core.records).as_dict(),
        }

    def pin(self) -> dict[str, Any] | None:
        """The session's own pin of the longest prefix (its last breakpoint's), not expired: its
        id, prefix length, TTL and expiry (Unix time); not the server-wide ``pinned_slots`` of
        the pin's answer. Every pin: ``pins``."""
        p = self.core.pins.pinned
        if p is None:
            return None
        return {"pin_id": p.pin_id, "pinned_tokens": p.pinned_tokens, "ttl_s": p.ttl_s,
                "expires_at": p.expires_at}  # fmt: skip

    def pins(self) -> list[dict[str, Any]]:
        """The session's pins not expired, one per breakpoint, by prefix length (as ``pin``)."""
        return [{"pin_id": p.pin_id, "pinned_tokens": p.pinned_tokens, "ttl_s": p.ttl_s,
                 "expires_at": p.expires_at} for p in self.core.pins.live()]  # fmt: skip

    def detail(self) -> dict[str, Any]:
        """The summary plus every turn's record (``GET /leyline/sessions/{id}``) and the state
        chain of its splices (``states``: turn, parent_state_id, state_id, replayed; the last
        64)."""
        return {
            **self.summary(),
            "records": [r.model_dump() for r in self.core.records],
            "states": list(self.core.states),
        }
