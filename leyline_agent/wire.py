"""What crosses HTTP to the Leyline routes: ``POST /leyline/splice``, ``/leyline/fork``,
``/leyline/pin`` and ``/leyline/unpin`` (bodies and responses), and the cache namespace.

Pydantic only (no sglang, no torch): the agent side (``client.py``, ``session.py``) imports it on a
core install; the server validates the same models (``routes.py`` in the HTTP process, the
executor again in the scheduler).
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

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


def state_id(
    tokens: Sequence[int],
    extra_key: str | None = None,
    cache_salt: str | None = None,
    lora_path: str | None = None,
) -> str:
    """The id of one cached sequence version: SHA-256 over the namespace ``(extra_key,
    cache_salt)`` (and the LoRA adapter's name, when one is named) and the token ids (int64), 32
    hex characters. Content-addressed, so the server computes the id of whatever it holds without
    remembering anything; chained through edits by ``SpliceResponse.parent_state_id`` (the version
    a splice was applied to)."""
    h = hashlib.sha256(b"leyline-state-v1\0")
    ns: list[str | None] = [extra_key, cache_salt or None, *([lora_path] if lora_path else [])]
    h.update(json.dumps(ns).encode())
    h.update(array("q", tokens).tobytes())
    return h.hexdigest()[:32]


def splice_key(parent_state: str, directives: Sequence[Directive], target: str | None) -> str:
    """A deterministic ``idempotency_key`` for one edit of one version: the same edit of the same
    state into the same target gets the same key (a client retry, or a restarted proxy sending
    it again, is then answered with the first answer instead of being applied twice)."""
    body = json.dumps([parent_state, target, [d.model_dump(mode="json") for d in directives]])
    return "leyline-" + hashlib.sha256(body.encode()).hexdigest()[:32]


class SpliceRequest(BaseModel):
    """``POST /leyline/splice`` body.

    tokens: the cached sequence (token ids) the directives refer to.
    directives: non-overlapping edits in old-sequence coordinates.
    extra_key: radix-cache namespace (SGLang's ``extra_key``); None is the default namespace.
    cache_salt: SGLang's ``cache_salt`` (also a namespace component).
    target_extra_key: where the edited sequence goes; None (default) or equal to ``extra_key``:
        the namespace it was matched in (an in-namespace splice). Another value: ``tokens`` are
        matched in ``(extra_key, cache_salt)`` (typically the tenant's shared namespace of exact
        KV) and the edited sequence is built in ``(target_extra_key, cache_salt)`` (the session's
        private one): the unchanged prefix is copied slot by slot (no prefill), the source path
        stays as it was (FORGET still purges the removed span from it).
    lora_path: the LoRA adapter the sequence was cached under, named as requests name it
        (SGLang's ``lora_path``: the NAME of ``--lora-paths NAME=DIR``); None: the base model.
        The splice matches and inserts in that adapter's namespace (SGLang keys it by
        ``extra_key + lora_id``) and runs its replacement prefill and FORGET's re-prefill with
        the adapter (``backends/sglang/lora.py``); 400 for an adapter the server has not loaded.
    dp_rank: with SGLang ``--dp-size`` > 1, the DP rank that holds the sequence; None (default):
        the home rank of the namespace, where the server pins its requests (``backends/sglang/
        dp.py``). A client that pins requests itself (``routed_dp_rank``) names the same rank here.
    expected_state: the ``state_id`` of ``tokens`` the client planned against; 409 when the
        cache no longer holds it (``tokens`` are not that state, or not all cached).
    idempotency_key: a retry with the same key and the same body gets the first 200 answer
        again (``replayed`` true) without the edit being applied twice; the same key with another
        body is a 409. Kept per namespace, bounded (the server's last 4,096 keys, 1 hour).
    debug_fault, debug_fail_after_prefill: test-only, honoured only with
        ``LEYLINE_DEBUG_ENDPOINTS=1`` (fault points: ``backends/sglang/ledger.py``).
    """

    model_config = ConfigDict(extra="forbid")

    tokens: list[StrictInt] = Field(min_length=1)
    directives: list[Directive] = Field(min_length=1)
    extra_key: str | None = None
    cache_salt: str | None = None
    target_extra_key: str | None = None
    lora_path: str | None = Field(default=None, min_length=1)
    dp_rank: StrictInt | None = Field(default=None, ge=0)
    expected_state: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$")
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=256)
    debug_fault: str | None = None
    debug_fail_after_prefill: bool = False

    @property
    def namespace(self) -> Namespace:
        return Namespace(self.extra_key, self.cache_salt)

    def digest(self) -> str:
        """SHA-256 (hex) of the body as validated, its ``idempotency_key`` left out: what an
        identical retry must repeat."""
        body = self.model_dump_json(exclude={"idempotency_key"})
        return hashlib.sha256(body.encode()).hexdigest()

    @property
    def crosses(self) -> bool:
        """The edited sequence goes into another namespace than the one it is matched in."""
        return self.target_extra_key is not None and self.target_extra_key != self.extra_key

    @property
    def target(self) -> Namespace:
        """The namespace the edited sequence is inserted in."""
        return Namespace(self.target_extra_key if self.crosses else self.extra_key, self.cache_salt)


class SpliceResponse(BaseModel):
    """``POST /leyline/splice`` result. Field names are a public contract: keep them.

    new_length: tokens of the spliced sequence now in the tree.
    prefix_reused: unchanged prefix tokens matched in the radix tree (first directive's start).
    prefilled: tokens run through the model (replacements; for FORGET, everything after it).
    rotated: downstream tokens whose KV was kept and δ-rotated.
    copied: downstream slots copied before rotation (another path shared them).
    purged: slots removed from the tree by FORGET.
    copied_prefix: prefix tokens copied slot by slot into the target namespace (a splice across
        namespaces; 0 otherwise).
    in_place: True when the downstream tail was rotated in place (owned by this path alone).
    elapsed_ms: scheduler-side wall time of the whole splice, in milliseconds.
    cached_before: tokens of ``tokens`` found cached (always all of them on success).
    timings_ms: the splice broken down, in milliseconds: ``prefill`` (replacement prefills),
        ``rotate`` (δ-rotation, copies and in place), ``tree`` (detach, purge, insert, frees).
    state_id: the new sequence version's ``state_id`` (its tokens in the target namespace).
    parent_state_id: the ``state_id`` of ``tokens``, the version the edit was applied to.
    slots_allocated: KV slots this splice took from the pool (replacement prefills, copies).
    slots_freed: KV slots it gave back (FORGET's purge, the dropped span and extension, slots the
        target already held). With ``prefix_reused`` (tokens reused), ``rotated`` and ``copied``
        (rows), the evidence of what the splice did.
    replayed: True when this is the stored answer to an earlier identical request (same
        ``idempotency_key``, same body): nothing was done this time.
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
    copied_prefix: int = 0
    in_place: bool
    elapsed_ms: float
    cached_before: int = 0
    timings_ms: dict[str, float] = Field(default_factory=dict)
    state_id: str = ""
    parent_state_id: str = ""
    slots_allocated: int = 0
    slots_freed: int = 0
    replayed: bool = False
    http_ms: float = Field(default=0.0, exclude=True)


class ForkRequest(BaseModel):
    """``POST /leyline/fork`` body: copy a cached sequence's KV into another namespace.

    tokens: the sequence (token ids), cached in full in ``(extra_key, cache_salt)``.
    extra_key, cache_salt: the source namespace.
    target_extra_key: the child's namespace (with the same ``cache_salt``); must differ from
        ``extra_key``. Splices there never touch the source.
    lora_path: the LoRA adapter both namespaces belong to (as ``SpliceRequest.lora_path``).
    dp_rank: as for ``SpliceRequest`` (the source namespace's home rank by default).
    """

    model_config = ConfigDict(extra="forbid")

    tokens: list[StrictInt] = Field(min_length=1)
    extra_key: str | None = None
    cache_salt: str | None = None
    target_extra_key: str
    lora_path: str | None = Field(default=None, min_length=1)
    dp_rank: StrictInt | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _other_namespace(self) -> ForkRequest:
        if self.target_extra_key == self.extra_key:
            raise ValueError("target_extra_key must differ from extra_key (a fork copies)")
        return self

    def as_splice(self) -> SpliceRequest:
        """The splice with no directive that the executor runs for it."""
        return SpliceRequest.model_construct(
            tokens=self.tokens,
            directives=[],
            extra_key=self.extra_key,
            cache_salt=self.cache_salt,
            target_extra_key=self.target_extra_key,
            lora_path=self.lora_path,
            dp_rank=self.dp_rank,
            expected_state=None,
            idempotency_key=None,
            debug_fault=None,
            debug_fail_after_prefill=False,
        )


class ForkResponse(BaseModel):
    """``POST /leyline/fork`` result. new_length: tokens of the sequence now in the target
    namespace; copied: slots copied for it (fewer when the target already held a prefix of it);
    elapsed_ms: scheduler-side wall time, milliseconds."""

    model_config = ConfigDict(frozen=True)

    new_length: int
    copied: int
    elapsed_ms: float


MAX_PIN_TTL_S = 86400.0


class PinRequest(BaseModel):
    """``POST /leyline/pin`` body: keep a cached prefix resident (never evicted) for a while.

    tokens: the prefix (token ids), cached in full in ``(extra_key, cache_salt)``.
    ttl_s: seconds, in ``(0, 86400]``; the pin is released when it expires (checked before every
        eviction and on every Leyline request), on ``/leyline/unpin``, or with its owner.
    owner: a label (e.g. the session's namespace) that ``/leyline/unpin`` can release by.
    dp_rank: as for ``SpliceRequest``.
    """

    model_config = ConfigDict(extra="forbid")

    tokens: list[StrictInt] = Field(min_length=1)
    extra_key: str | None = None
    cache_salt: str | None = None
    ttl_s: float = Field(gt=0, le=MAX_PIN_TTL_S)
    owner: str | None = None
    dp_rank: StrictInt | None = Field(default=None, ge=0)


class PinResponse(BaseModel):
    """``POST /leyline/pin`` result. pin_id: the handle for ``/leyline/unpin``; pinned_tokens:
    the prefix length pinned; expires_at: Unix time (seconds); pinned_slots: slots the server's
    pins hold now (a slot under several pins counts once); pin_cap_slots: the most they may hold
    (``--max-pinned-fraction`` of the pool)."""

    model_config = ConfigDict(frozen=True)

    pin_id: str
    pinned_tokens: int
    ttl_s: float
    expires_at: float
    pinned_slots: int
    pin_cap_slots: int


class UnpinResult(BaseModel):
    """``POST /leyline/unpin`` result: pins released, and the slots still pinned after it."""

    model_config = ConfigDict(frozen=True)

    released: int
    pinned_slots: int


class UnpinRequest(BaseModel):
    """``POST /leyline/unpin`` body: exactly one of ``pin_id`` (404 when unknown or expired) and
    ``owner`` (every pin of that owner; none is not an error). ``dp_rank``: None releases on every
    DP rank."""

    model_config = ConfigDict(extra="forbid")

    pin_id: str | None = None
    owner: str | None = None
    dp_rank: StrictInt | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _one(self) -> UnpinRequest:
        if (self.pin_id is None) == (self.owner is None):
            raise ValueError("give exactly one of pin_id and owner")
        return self
