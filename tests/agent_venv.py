"""A venv of its own for an agent framework whose pins clash with SGLang's environment
(mini-swe-agent, the OpenAI Agents SDK, pydantic-ai): created once from PyPI under
``$LEYLINE_CACHE/<name>-<version>/venv``, then reused (a lock file keeps parallel runs apart)."""

from __future__ import annotations

import fcntl
import subprocess
from pathlib import Path

from leyline_agent.cache import cache_root
from leyline_agent.evals.debug_gym.venv import find_python312


def ensure_venv(name: str, version: str, requirement: str) -> Path:
    """The venv's python, with ``requirement`` (a pip requirement of ``version``) installed."""
    root = cache_root() / f"{name}-{version}" / "venv"
    python, stamp = root / "bin" / "python", root / ".leyline-installed"
    if stamp.is_file() and python.is_file():
        return python
    root.parent.mkdir(parents=True, exist_ok=True)
    with (root.parent / ".venv.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (stamp.is_file() and python.is_file()):
            if not python.is_file():
                subprocess.run([find_python312(), "-m", "venv", str(root)], check=True)
            pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            subprocess.run([*pip, requirement], check=True)
            stamp.write_text(version + "\n")
    return python
