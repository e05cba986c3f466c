"""What crosses HTTP to ``POST /leyline/splice``: the body, the response and the cache namespace.

Pydantic only (no sglang, no torch): the agent side (``client.py``, ``session.py``) imports it on a
core install; the server validates the same models (``routes.py`` in the HTTP process, the
executor again in the scheduler).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from leyline_agent.directive import Directive


class Namespace(NamedTuple):
    """A radix-cache namespace: SGLang keys its tree by ``(extra_key, cache_salt)``, and
    namespaces share no node. The chat request that caches a sequence and the splice that edits it
    must name the same one, so both build their body fields here."""

    extra_key: str | None = None
    cache_salt: str | None = None

    def fields(self) -> dict[str, str]:
        """The body fields selecting this namespace (unset components are not sent)."""
        out = {}
        if self.extra_key is not None:
            out["extra_key"] = self.extra_key
        if self.cache_salt:
            out["cache_salt"] = self.cache_salt
        return out

    def apply(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """``body`` moved into this namespace (its own ``extra_key``/``cache_salt`` replaced)."""
        out = {k: v for k, v in body.items() if k not in ("extra_key", "cache_salt")}
        return {**out, **self.fields()}


class SpliceRequest(BaseModel):
    """``POST /leyline/splice`` body.

    tokens: the cached sequence (token ids) the directives refer to.
    directives: non-overlapping edits in old-sequence coordinates.
    extra_key: radix-cache namespace (SGLang's ``extra_key``); None is the default namespace.
    cache_salt: SGLang's ``cache_salt`` (also a namespace component).
    dp_rank: with SGLang ``--dp-size`` > 1, the DP rank that holds the sequence; None (default):
        the home rank of the namespace, where the server pins its requests (``backends/sglang/
        dp.py``). A client that pins requests itself (``routed_dp_rank``) names the same rank here.
    debug_fault, debug_fail_after_prefill: test-only, honoured only with
        ``LEYLINE_DEBUG_ENDPOINTS=1`` (fault points: ``backends/sglang/ledger.py``).
    """

    model_config = ConfigDict(extra="forbid")

    tokens: list[StrictInt] = Field(min_length=1)
    directives: list[Directive] = Field(min_length=1)
    extra_key: str | None = None
    cache_salt: str | None = None
    dp_rank: StrictInt | None = Field(default=None, ge=0)
    debug_fault: str | None = None
    debug_fail_after_prefill: bool = False

    @property
    def namespace(self) -> Namespace:
        return Namespace(self.extra_key, self.cache_salt)


class SpliceResponse(BaseModel):
    """``POST /leyline/splice`` result. Field names are a public contract: keep them.

    new_length: tokens of the spliced sequence now in the tree.
    prefix_reused: unchanged prefix tokens matched in the radix tree (first directive's start).
    prefilled: tokens run through the model (replacements; for FORGET, everything after it).
    rotated: downstream tokens whose KV was kept and δ-rotated.
    copied: downstream slots copied before rotation (another path shared them).
    purged: slots removed from the tree by FORGET.
    in_place: True when the downstream tail was rotated in place (owned by this path alone).
    elapsed_ms: scheduler-side wall time of the whole splice, in milliseconds.
    cached_before: tokens of ``tokens`` found cached (always all of them on success).
    timings_ms: the splice broken down, in milliseconds: ``prefill`` (replacement prefills),
        ``rotate`` (δ-rotation, copies and in place), ``tree`` (detach, purge, insert, frees).
    http_ms: client side only (``LeylineClient.splice``): the HTTP round trip in milliseconds;
        never sent by the server.
    """

    model_config = ConfigDict(frozen=True)

    new_length: int
    prefix_reused: int
    prefilled: int
    rotated: int
    copied: int = 0
    purged: int = 0
    in_place: bool
    elapsed_ms: float
    cached_before: int = 0
    timings_ms: dict[str, float] = Field(default_factory=dict)
    http_ms: float = Field(default=0.0, exclude=True)
