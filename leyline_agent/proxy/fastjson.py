"""JSON on the proxy's hot path with ``orjson`` (about 3-5x faster than ``json`` on a 30k-token
chat body), falling back to ``json`` for what ``orjson`` refuses, so the outcome is ``json``'s:
a lone surrogate escape (``"\\udcff"``: parsed, then refused by ``chat.request.text_error`` with
its place), an integer past 64 bits.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def loads(raw: bytes) -> Any:
    """``json.loads(raw)``.

    Raises:
        ValueError: ``raw`` is not JSON.
    """
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def dumps(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON (what the backend parses back to ``value``)."""
    try:
        return orjson.dumps(value)
    except TypeError:  # NOTE: orjson.JSONEncodeError is a TypeError (surrogates, big ints)
        return json.dumps(value, separators=(",", ":")).encode()  # NOTE: ASCII, escapes kept
