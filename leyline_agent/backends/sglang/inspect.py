"""``/leyline/stats`` and the debug views (scheduler side of ``InspectReqInput``).

``{"op": "stats"}`` always (``integrity.stats``); with ``LEYLINE_DEBUG_ENDPOINTS=1`` also
``{"op": "rows", "tokens": [...], "extra_key": ..., "lora_path": ...}`` (the KV rows of a cached sequence and the RoPE
the server rotates with) and ``{"op": "tree_slots"}`` (every slot the tree holds).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from leyline_agent.backends.sglang import integrity
from leyline_agent.backends.sglang.errors import SpliceError, debug_enabled
from leyline_agent.backends.sglang.lora import lora_key, resolve
from leyline_agent.backends.sglang.preflight import Served

logger = logging.getLogger(__name__)


def handle_inspect(served: Served, payload: str) -> tuple[int, str]:
    """Returns ``(http_status, json_body)``; never raises."""
    try:
        req = json.loads(payload)
        op = req.get("op")
        if op == "stats":
            pins = getattr(served.scheduler.tree_cache, "pins", None)
            if pins is not None:
                pins.expire()
            return 200, json.dumps(integrity.stats(served.scheduler))
        if not debug_enabled():
            return 403, json.dumps({"error": "debug endpoints are disabled"})
        if op == "rows":
            rope: dict[str, Any]
            try:
                spec, band, source = served.rope_spec()
                rope = {"spec": dataclasses.asdict(spec), "band": band, "source": source}
            except SpliceError as e:
                rope = {"error": str(e)}
            lora_id = resolve(served.scheduler, req.get("lora_path"))
            key = lora_key(req.get("extra_key"), lora_id)  # the adapter's namespace (lora.py)
            body = integrity.rows(served.tree, served.kv_buffers(), req["tokens"], key, rope)
            return 200, json.dumps(body)
        if op == "tree_slots":
            return 200, json.dumps({"slots": served.tree.all_slots().tolist()})
        return 400, json.dumps({"error": f"unknown op {op!r}"})
    except SpliceError as e:
        return e.status, json.dumps(e.body())
    except Exception as e:
        logger.exception("leyline inspect failed")
        return 500, json.dumps({"error": repr(e)})
