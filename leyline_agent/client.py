"""HTTP client for a Leyline-enabled SGLang server (``leyline serve``). Pure httpx.

Endpoints: ``POST /leyline/splice``, ``/leyline/fork``, ``/leyline/pin``, ``/leyline/unpin``
(see ``leyline_agent/wire.py`` for the bodies and the response fields), ``GET /leyline/stats``,
and SGLang's own ``POST /generate`` with ``input_ids``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import httpx

from leyline_agent.directive import Directive
from leyline_agent.wire import (
    ForkRequest,
    ForkResponse,
    Namespace,
    PinResponse,
    SpliceResponse,
    UnpinRequest,
)


class SpliceRejected(RuntimeError):
    """The server refused or failed a splice (or a fork, pin, unpin: ``what``); the cache is
    unchanged.

    status: HTTP status (400/422 bad input, 404 unknown pin, 409 not cached or in use, 429 pin cap
    reached, 501 no plugin, 503 pool exhausted, 500 failed and rolled back, 0 backend
    unreachable).
    """

    what = "splice"

    def __init__(self, status: int, message: str):
        super().__init__(f"{self.what} rejected ({status}): {message}")
        self.status = status
        self.message = message

    @property
    def reason(self) -> str:
        """A short, stable name for metrics: ``not_cached``, ``in_use``, ``pool_full``,
        ``unsupported``, ``no_plugin``, ``unreachable``, ``unauthorized``, ``bad_request``,
        ``backend_error``."""
        return miss_reason(self.status, self.message)


class ForkRejected(SpliceRejected):
    """``POST /leyline/fork`` refused (409 not cached in the source, 422 bad body or target ==
    source, 503 no room); nothing was copied."""

    what = "fork"


class PinRejected(SpliceRejected):
    """``POST /leyline/pin`` or ``/leyline/unpin`` refused (409 not cached, 422 bad body or
    ``ttl_s`` outside (0, 86400], 429 the pinned share of the pool would pass the server's cap,
    404 unknown ``pin_id``); nothing changed."""

    what = "pin"


def miss_reason(status: int, message: str = "") -> str:
    """Classify a splice refusal (see :class:`SpliceRejected`)."""
    if status == 0:
        return "unreachable"
    if status == 404:
        return "no_plugin"
    if status in (401, 403):
        return "unauthorized"
    if status == 409:
        return "in_use" if "running request" in message else "not_cached"
    if status == 429:
        return "pin_cap"
    if status == 503:
        return "pool_full"
    if status == 501:
        return "unsupported"
    if 400 <= status < 500:
        return "bad_request"
    return "backend_error"


class GenerateResult(NamedTuple):
    output_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    e2e_ms: float
    meta: dict[str, Any]


def auth_headers(api_key: str | None) -> dict[str, str]:
    """``Authorization: Bearer <api_key>`` (none without a key): a ``leyline serve --api-key``
    refuses every route but ``/health`` and ``/metrics`` without it (401)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class LeylineClient:
    """``LeylineClient("http://127.0.0.1:30000")``. Thread-safe (one httpx.Client).

    ``timeout``: seconds for every request, or an ``httpx.Timeout`` (e.g. a shorter connect
    timeout). ``api_key``: the backend's key (``leyline serve --api-key``), sent on every request.
    ``gateway``: the URL is a gateway (``smg``) in front of several workers: sessions send their
    edits in-band and a routing key (``gateway.py``); ``/leyline/*`` does not reach a worker.
    None (default): found out on first use (``gateway`` property).
    """

    def __init__(
        self,
        base_url: str,
        timeout: float | httpx.Timeout = 600.0,
        *,
        api_key: str | None = None,
        gateway: bool | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self._gateway = gateway
        self.http = httpx.Client(
            base_url=self.base_url, timeout=timeout, headers=auth_headers(api_key)
        )
        self._context_len: int | None = None

    def close(self) -> None:
        self.http.close()

    @property
    def gateway(self) -> bool:
        """The URL is a gateway, not a ``leyline serve``: asked once when not given. ``smg``
        answers ``GET /leyline/stats`` with 404 and the error code ``unknown_url``; a worker
        answers it (a backend that cannot be reached counts as no gateway, asked again later)."""
        if self._gateway is None:
            try:
                r = self.http.get("/leyline/stats")
                error = r.json().get("error") if r.status_code == 404 else None
            except (httpx.HTTPError, ValueError, AttributeError):
                return False
            self._gateway = isinstance(error, dict) and error.get("code") == "unknown_url"
        return self._gateway

    def __enter__(self) -> LeylineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def splice(
        self,
        tokens: Sequence[int],
        directives: Sequence[Directive],
        *,
        extra_key: str | None = None,
        cache_salt: str | None = None,
        target_extra_key: str | None = None,
        lora_path: str | None = None,
        expected_state: str | None = None,
        idempotency_key: str | None = None,
        retries: int = 1,
        **extra: Any,
    ) -> SpliceResponse:
        """Run directives on the cached ``tokens`` in the namespace ``(extra_key, cache_salt)``
        (the one the chat or generate request that cached them used). ``target_extra_key``: build
        the edited sequence in ``(target_extra_key, cache_salt)`` instead (the unchanged prefix
        copied, the source left as it was). ``lora_path``: the LoRA adapter the sequence was cached
        under, named as the requests name it (SGLang's ``lora_path``); the splice edits that
        adapter's namespace and prefills with it (None: the base model). ``expected_state``: the ``wire.state_id`` the edit
        was planned against (409 when the cache no longer holds it). ``idempotency_key``: with
        one, a splice whose answer was lost (timeout, dropped connection) is sent again, up to
        ``retries`` times, with the same key and body: the server answers a retry of an applied
        edit with the first answer (``replayed``) instead of applying it twice. Returns the
        server's response with ``http_ms`` set. Raises :class:`SpliceRejected`."""
        body = {
            "tokens": list(tokens),
            "directives": [d.model_dump(mode="json") for d in directives],
            "extra_key": extra_key,
            **extra,
            **Namespace(extra_key, cache_salt).fields(),
        }
        if target_extra_key is not None:
            body["target_extra_key"] = target_extra_key
        if lora_path is not None:
            body["lora_path"] = lora_path
        if expected_state is not None:
            body["expected_state"] = expected_state
        if idempotency_key is not None:
            body["idempotency_key"] = idempotency_key
        resends = retries if idempotency_key is not None else 0
        for attempt in range(resends + 1):
            try:
                data, http_ms = self._post("/leyline/splice", body, SpliceRejected)
                break
            except SpliceRejected as e:  # status 0: no answer (it may have been applied)
                if e.status != 0 or attempt >= resends:
                    raise
        return SpliceResponse.model_validate({**data, "http_ms": http_ms})

    def fork(
        self,
        tokens: Sequence[int],
        *,
        extra_key: str | None,
        target_extra_key: str,
        cache_salt: str | None = None,
        lora_path: str | None = None,
    ) -> ForkResponse:
        """Copy the KV of ``tokens`` (cached in full in ``(extra_key, cache_salt)``) into
        ``(target_extra_key, cache_salt)``; ``lora_path``: under that LoRA adapter (both
        namespaces its). Raises :class:`ForkRejected`."""
        body = ForkRequest(
            tokens=list(tokens),
            extra_key=extra_key,
            cache_salt=cache_salt or None,
            target_extra_key=target_extra_key,
            lora_path=lora_path,
        )
        data, _ = self._post("/leyline/fork", body.model_dump(exclude_none=True), ForkRejected)
        return ForkResponse.model_validate(data)

    def pin(
        self,
        tokens: Sequence[int],
        *,
        ttl_s: float,
        extra_key: str | None = None,
        cache_salt: str | None = None,
        owner: str | None = None,
    ) -> PinResponse:
        """Keep the cached prefix ``tokens`` of ``(extra_key, cache_salt)`` resident for
        ``ttl_s`` seconds (or until unpinned). Raises :class:`PinRejected` (429: the server's cap
        on the pinned share of its pool)."""
        body = {
            "tokens": list(tokens),
            "ttl_s": ttl_s,
            "extra_key": extra_key,
            **Namespace(extra_key, cache_salt).fields(),
        }
        if owner is not None:
            body["owner"] = owner
        data, _ = self._post("/leyline/pin", body, PinRejected)
        return PinResponse.model_validate(data)

    def unpin(self, pin_id: str | None = None, *, owner: str | None = None) -> int:
        """Release one pin (``pin_id``; 404 when unknown or expired) or every pin of ``owner``;
        returns the pins released. Raises :class:`PinRejected`."""
        body = UnpinRequest(pin_id=pin_id, owner=owner).model_dump(exclude_none=True)
        data, _ = self._post("/leyline/unpin", body, PinRejected)
        return int(data.get("released", 0))

    def _post(
        self, path: str, body: dict[str, Any], rejected: type[SpliceRejected]
    ) -> tuple[dict[str, Any], float]:
        """POST a Leyline route: ``(the JSON answer, round trip in ms)``; any other answer than
        200 raises ``rejected`` (status 0: unreachable)."""
        t0 = time.perf_counter()
        try:
            r = self.http.post(path, json=body)
        except httpx.HTTPError as e:
            raise rejected(0, f"backend unreachable: {e}") from e
        http_ms = (time.perf_counter() - t0) * 1e3
        try:
            data = r.json()
        except ValueError:
            data = None
        if r.status_code == 404 and not (isinstance(data, dict) and "error" in data):
            raise rejected(404, f"backend has no {path} (not started by leyline serve)")
        if not isinstance(data, dict):
            raise rejected(r.status_code, r.text[:500])
        if r.status_code != 200:
            error = data.get("error", data)
            if isinstance(error, dict) and "message" in error:  # SGLang's error format
                error = error["message"]
            raise rejected(r.status_code, str(error))
        return data, http_ms

    def generate(
        self,
        input_ids: Sequence[int],
        *,
        extra_key: str | None = None,
        cache_salt: str | None = None,
        max_new_tokens: int = 1,
        top_logprobs: int = 0,
        **sampling: Any,
    ) -> GenerateResult:
        """SGLang ``/generate`` with token ids, greedy by default; ``top_logprobs`` > 0: also the
        top log-probabilities of each output position (``meta["output_top_logprobs"]``: per
        position ``[logprob, token_id, text]`` rows, highest first). Raises
        ``httpx.HTTPError``."""
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, **sampling}
        body: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": params}
        if top_logprobs > 0:
            body.update(return_logprob=True, top_logprobs_num=top_logprobs)
        body.update(Namespace(extra_key, cache_salt).fields())
        t0 = time.perf_counter()
        r = self.http.post("/generate", json=body)
        r.raise_for_status()
        e2e = (time.perf_counter() - t0) * 1e3
        data = r.json()
        meta = data.get("meta_info", {})
        return GenerateResult(
            output_ids=list(data.get("output_ids") or []),
            prompt_tokens=int(meta.get("prompt_tokens", len(input_ids))),
            cached_tokens=int(meta.get("cached_tokens", 0)),
            e2e_ms=e2e,
            meta=meta,
        )

    def stats(self) -> dict[str, Any]:
        r = self.http.get("/leyline/stats")
        r.raise_for_status()
        return r.json()

    def context_len(self) -> int | None:
        """The served model's context length in tokens (``max_model_len`` of
        ``GET /v1/models``), read once; None while the backend does not say (unreachable, or an
        answer without it)."""
        if self._context_len is None:
            try:
                r = self.http.get("/v1/models")
                value = (r.json().get("data") or [{}])[0].get("max_model_len")
            except (httpx.HTTPError, ValueError, AttributeError, IndexError):
                return None
            self._context_len = value if isinstance(value, int) and value > 0 else None
        return self._context_len
