"""In-band edits: a splice that rides on the generation request that uses it.

A gateway (the SGLang Model Gateway ``smg``) forwards ``/generate`` and ``/v1/chat/completions``
with every body field, unknown ones included, but answers 404 to any other route
(``/leyline/splice`` included), so an edit reaches the worker that holds a session's KV only inside
that session's request. The request body carries the directives under ``FIELD``
(``"leyline_splice"``: a ``wire.SpliceRequest`` whose namespace fields may be left out), the worker
runs the splice before it admits the request (``backends/sglang/inband.py``) and answers:

- the splice ran: the request's normal answer, with the ``wire.SpliceResponse`` as JSON in the
  ``RESULT_HEADER`` response header (``x-leyline-splice``);
- the splice was refused or failed: a 4xx (``REFUSED_HEADER`` names the splice's own status,
  e.g. 503 no room), the body the splice route would answer; the request did not run and the
  cache is unchanged.

Every answer of those two routes names the worker process in ``WORKER_HEADER``
(``x-leyline-worker``, a random id per server start): a session whose next answer names another
worker was moved by the gateway (its KV stayed behind). ``ROUTING_HEADER`` (``x-smg-routing-key``) is the header ``smg`` hashes by default with
``--policy consistent_hashing``: the session layer sends its own namespace there on every request,
so a session's turns, and the edits in them, stay on one worker.

Pure pydantic (no torch, no sglang); the client and the SGLang plugin both use it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from leyline_agent.directive import Directive
from leyline_agent.wire import SpliceRequest, SpliceResponse

FIELD = "leyline_splice"
RESULT_HEADER = "x-leyline-splice"
REFUSED_HEADER = "x-leyline-splice-refused"
ROUTING_HEADER = "x-smg-routing-key"
WORKER_HEADER = "x-leyline-worker"
ROUTES = ("/generate", "/v1/chat/completions")


class InbandError(ValueError):
    """An in-band splice that cannot apply to its request (answered 400, nothing run)."""


def payload(
    tokens: Sequence[int],
    directives: Sequence[Directive],
    *,
    extra_key: str | None,
    target_extra_key: str | None = None,
) -> dict[str, Any]:
    """The ``FIELD`` value of a request: the splice of the cached ``tokens`` (matched in
    ``extra_key``; the edited sequence built in ``target_extra_key`` when given, which must then
    be the request's own ``extra_key``). The salt is the request's."""
    out: dict[str, Any] = {
        "tokens": list(tokens),
        "directives": [d.model_dump(mode="json") for d in directives],
        "extra_key": extra_key,
    }
    if target_extra_key is not None:
        out["target_extra_key"] = target_extra_key
    return out


def lora_adapter(body: Mapping[str, Any]) -> str | None:
    """The LoRA adapter a request body names, as SGLang's OpenAI routes read it
    (``serving_base._resolve_lora_path``: ``model: "BASE:NAME"`` first, then ``lora_path``; None:
    the base model). A model name that itself holds a colon is split at its first colon, as
    SGLang does for any name but its exact served one (which the proxy does not know): such a
    session's splices then name an adapter its requests do not, and are refused (400), costing
    reuse, never correctness."""
    model = body.get("model")
    if isinstance(model, str) and ":" in model:
        adapter = model.split(":", 1)[1].strip()
        if adapter:
            return adapter
    lora = body.get("lora_path")
    return lora if isinstance(lora, str) and lora else None


def resolve(value: Any, body: Mapping[str, Any]) -> SpliceRequest:
    """The splice a request ``body`` carries in ``FIELD`` (``value``), in the request's namespace.

    ``extra_key`` left out: the request's; ``cache_salt`` left out: the request's; ``lora_path``
    left out: the request's ``lora_path`` (its LoRA adapter, a str; a splice may also name the
    adapter of an OpenAI ``model: "BASE:NAME"``, ``lora_adapter``); ``dp_rank`` left out: the request's
    ``routed_dp_rank`` (or ``data_parallel_rank``) when it names one. The edited sequence
    (``target_extra_key``, else ``extra_key``) must be the request's ``extra_key``, and the salt
    and the adapter the request's: else the request would not find it.

    Raises:
        InbandError: not an object, a batch request, invalid (pydantic's message), or another
            namespace than the request's.
    """
    if not isinstance(value, dict):
        raise InbandError(f"{FIELD!r} must be an object (a splice request)")
    key, salt = body.get("extra_key"), body.get("cache_salt") or None
    lora = body.get("lora_path") or None
    if not all(v is None or isinstance(v, str) for v in (key, salt, lora)):
        raise InbandError(
            f"{FIELD!r} needs a single request (a string extra_key, cache_salt and lora_path)"
        )
    data = dict(value)
    data.setdefault("extra_key", key)
    data.setdefault("cache_salt", salt)
    data.setdefault("lora_path", lora)
    rank = body.get("routed_dp_rank", body.get("data_parallel_rank"))
    if data.get("dp_rank") is None and isinstance(rank, int) and not isinstance(rank, bool):
        data["dp_rank"] = rank
    try:
        req = SpliceRequest.model_validate(data)
    except ValidationError as e:
        raise InbandError(f"invalid {FIELD!r}: {e}") from e
    target = req.target_extra_key or req.extra_key
    adapters = {lora, lora_adapter(body)}
    if target != key or (req.cache_salt or None) != salt or req.lora_path not in adapters:
        raise InbandError(
            f"{FIELD!r} builds its sequence in namespace ({target!r}, {req.cache_salt!r}, "
            f"lora_path={req.lora_path!r}), the request reads ({key!r}, {salt!r}, "
            f"lora_path={lora!r})"
        )
    return req


def result(headers: Mapping[str, str]) -> SpliceResponse | None:
    """The splice result a worker answered in ``RESULT_HEADER`` (None: no in-band splice ran)."""
    raw = headers.get(RESULT_HEADER)
    return None if raw is None else SpliceResponse.model_validate_json(raw)


def refusal(status: int, headers: Mapping[str, str], data: Any) -> tuple[int, str] | None:
    """``(the splice's status, its message)`` of an answer that refused an in-band splice
    (``REFUSED_HEADER`` set); None for any other answer."""
    raw = headers.get(REFUSED_HEADER)
    if raw is None:
        return None
    error = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(error, dict):
        error = error.get("message", error)
    return (int(raw) if raw.isdigit() else status), str(error)
