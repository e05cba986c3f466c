"""Leyline's cache directory: ``$LEYLINE_CACHE``, default ``~/.cache/leyline``.

Holds what is generated rather than committed: the embedded tokenizer and model directory, the
debug-gym venv, the trained fidelity model.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    env = os.environ.get("LEYLINE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "leyline"
