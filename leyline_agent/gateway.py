"""A session behind a gateway (``smg``): its edits in-band, its routing key on every request.

The gateway answers 404 to ``/leyline/*`` and routes each request by its routing key, so a session
cannot splice out of band there. With a client made with ``gateway=True`` the chat turn
(``chat_turn.py``) and the ``/generate`` turn (``generate_turn.py``) do instead::

    edit = gateway.defer(core, pending)        # instead of core.splice: the in-band payload
    ...send the request with routing_headers(core) and, when edit, body[inband.FIELD] = edit...
    resend = gateway.settle(core, pending, edit, status, headers, data)
    ...when resend: send it again without the field (a cold prefill, the miss counted)...

``settle`` reads the answer: the splice ran (``x-leyline-splice``: committed as ``core.splice``
commits), was refused (``x-leyline-splice-refused``: a miss with its reason, ``failover`` when
another worker answered than the session's last one, the request not run: resend it), or the
worker has no plugin (a miss ``no_plugin``; the request ran on the full prompt). The routing key
is the session's own namespace (``Placement.own``): stable for the session's life, whether it is
shared or private. Pure Python (no I/O).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from leyline_agent import inband
from leyline_agent.accounting import SpliceOutcome
from leyline_agent.client import miss_reason
from leyline_agent.session import Pending, SessionCore
from leyline_agent.token_changes import common_prefix
from leyline_agent.wire import Namespace, splice_key, state_id


def routing_headers(core: SessionCore) -> dict[str, str]:
    """The header the gateway hashes (``inband.ROUTING_HEADER``: the session's own namespace)."""
    return {inband.ROUTING_HEADER: core.placement.own}


def defer(core: SessionCore, pending: Pending) -> dict[str, Any] | None:
    """``core.splice`` for a gateway: the ``inband.FIELD`` payload of this turn's edits, sent with
    the request (nothing is committed yet); None when no edit is sent (then ``core.splice`` ran:
    no directives, splicing off, nothing held, or the session moved)."""
    plan, where = pending.plan, core.placement
    if not (core.splice_enabled and plan.directives and core.wrapper.tokens) or where.moved:
        core.splice(pending)
        return None
    edit = inband.payload(
        core.wrapper.tokens, plan.directives, extra_key=where.extra_key,
        target_extra_key=where.splice_target(),
    )  # fmt: skip
    if where.adapter is not None:  # NOTE: the request may name it in its model only
        edit["lora_path"] = where.adapter
    parent = state_id(core.wrapper.tokens, where.extra_key, where.salt, where.adapter)
    edit["expected_state"] = parent  # NOTE: as core.splice sends them
    edit["idempotency_key"] = splice_key(parent, plan.directives, where.splice_target())
    return edit


def namespace(core: SessionCore, edit: dict[str, Any] | None) -> Namespace:
    """The namespace of the request: where its in-band splice builds the edited sequence (the
    session's own), else the session's request namespace."""
    where = core.placement
    return Namespace(where.own, where.salt) if edit is not None else where.request


def settle(
    core: SessionCore,
    pending: Pending,
    edit: dict[str, Any] | None,
    status: int,
    headers: Mapping[str, str],
    data: Any,
) -> bool:
    """Read one answer of a request sent with ``edit`` (``defer``); True: the in-band splice was
    refused and the request did not run, send it again without the field. Remembers the worker
    that answered (``inband.WORKER_HEADER``)."""
    worker = headers.get(inband.WORKER_HEADER)
    where = core.placement
    moved = worker is not None and where.worker is not None and worker != where.worker
    if worker is not None:
        where.worker = worker
    if edit is None:
        return False
    plan = pending.plan
    held = common_prefix(core.wrapper.tokens, plan.tokens)
    best = len(plan.tokens) if not where.private else pending.splice.best_reused
    refused = inband.refusal(status, headers, data)
    if refused is not None:
        code, message = refused
        reason = "failover" if moved else miss_reason(code, message)
        error = f"failover: worker {worker}: {message}" if moved else f"{code}: {message}"
        best = 0 if moved else best
        pending.splice = SpliceOutcome(None, error, reason, 0.0, best, held, not where.private)
        return True
    result = inband.result(headers) if status == 200 else None
    if result is None:  # NOTE: answered without our plugin: the full prompt ran unspliced
        if status == 200:
            why = "the worker ran no in-band splice (no Leyline plugin?)"
            pending.splice = SpliceOutcome(
                None, why, "no_plugin", 0.0, best, held, not where.private
            )
        return False
    where.spliced()
    pending.splice = SpliceOutcome(
        result, None, None, result.elapsed_ms, pending.splice.best_reused, held
    )
    core.states.append({
        "turn": len(core.records), "parent_state_id": result.parent_state_id,
        "state_id": result.state_id, "replayed": result.replayed,
    })  # fmt: skip
    core.wrapper.commit(plan, plan.tokens[: len(plan.tokens) - len(plan.tail)])
    pending.committed = True
    return False


def without_edit(core: SessionCore, body: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` sent again after its in-band splice was refused: no ``inband.FIELD``, in the
    session's request namespace (nothing was spliced)."""
    rest = {k: v for k, v in body.items() if k != inband.FIELD}
    return core.placement.request.apply(rest)
