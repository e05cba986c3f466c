"""Where the workplace's shared data (public agent traces, mini_nightmare) lives.

Read by path, never copied into the repository. Looked up in order: ``$LEYLINE_SHARED_DIR``,
``<checkout>/../shared``, ``/work/shared``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def shared_dir(sub: str) -> Path | None:
    """``<shared>/<sub>`` from the first candidate that has it, else None."""
    candidates = [os.environ.get("LEYLINE_SHARED_DIR"), REPO.parent / "shared", "/work/shared"]
    for c in candidates:
        if c and (Path(c) / sub).is_dir():
            return Path(c) / sub
    return None


def traces_dir() -> Path:
    """The shared public traces; skips (with the reason) where this machine has none."""
    path = shared_dir("traces")
    if path is None:
        pytest.skip(
            "shared traces not found (set LEYLINE_SHARED_DIR to the folder holding traces/)"
        )
    return path
