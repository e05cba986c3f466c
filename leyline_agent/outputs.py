"""What a runner leaves in its results directory: ``results.json`` and PNG figures.

Shared by the runners that write both (``bench/splice``, ``replay/report.py``,
``evals/debug_gym/report.py``). Importing it needs neither matplotlib nor torch; `pyplot` loads
matplotlib (headless ``Agg`` backend) on first use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 120


def write_results(out: Path, arguments: BaseModel, env: dict[str, Any], **sections: Any) -> Path:
    """``out/results.json``: ``{"arguments": <the run's spec>, "environment": env, **sections}``
    (sections in the order given), one space of indent, a final newline. Creates ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {"arguments": arguments.model_dump(mode="json"), "environment": env, **sections}
    path = out / "results.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the headless ``Agg`` backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Figure, path: Path) -> Path:
    """Write ``fig`` to ``path`` (PNG at `DPI`), close it, return ``path``."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
