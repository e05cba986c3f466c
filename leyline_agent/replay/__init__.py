"""``leyline replay``: recorded agent traces replayed through three arms against a Leyline backend.

- ``spec.py``: ``ReplaySpec`` (the run's arguments), ``TurnRow`` (one replayed turn).
- ``runner.py``: one ``SessionCore`` per (concurrency level, trace, arm; arms in
  ``leyline_agent.arms``), sessions in parallel per level, the argmax reference path.
- ``report.py``: per-arm totals (``accounting.Totals``), the terminal table, ``results.json``.
- ``plots.py``: the PNG plots.
- ``examples_dir()``: the built-in example traces (written for this project, OpenAI-message JSONL).

Pure Python (httpx, rich; matplotlib for the plots); the backend is any ``leyline serve``.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def examples_dir() -> Path:
    """Directory of the built-in example traces (package data, ``leyline_agent/data/examples``)."""
    return Path(str(resources.files("leyline_agent") / "data" / "examples"))
