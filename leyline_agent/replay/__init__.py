"""``leyline replay``: recorded agent traces replayed through three arms against a Leyline backend.

- ``runner.py``: the arms (``none``, ``reprefill``, ``splice``), one ``SessionCore`` per
  (concurrency level, trace, arm), sessions in parallel per level, the argmax reference path.
- ``report.py``: per-arm totals, the terminal table, ``results.json`` and the PNG plots.
- ``examples_dir()``: the built-in example traces (written for this project, OpenAI-message JSONL).

Pure Python (httpx, rich; matplotlib for the plots); the backend is any ``leyline serve``.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal

Arm = Literal["none", "reprefill", "splice"]
ARMS: tuple[Arm, ...] = ("none", "reprefill", "splice")
DEFAULT_POLICY = "stale_tool_outputs:keep_last=2"


def examples_dir() -> Path:
    """Directory of the built-in example traces (package data, ``leyline_agent/data/examples``)."""
    return Path(str(resources.files("leyline_agent") / "data" / "examples"))
