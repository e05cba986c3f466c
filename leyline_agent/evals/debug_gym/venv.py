"""debug-gym's own virtual environment: created once, reused, installed offline from PyPI.

debug-gym 1.3.0 pins openai, transformers and pytest versions that clash with SGLang's, so it
cannot share Leyline's environment. ``pip install debug-gym==1.3.0`` fails without a network
beyond the package registries (``swesmith==0.0.4`` pulls an unpinned ``sglang`` whose
``cuda-tile`` dependency lives on another registry). What works (about a minute, ~730 MB):

1. ``pip install --no-deps debug-gym==1.3.0 swesmith==0.0.4 swebench==4.0.3``;
2. debug-gym's own pinned runtime dependencies, plus what ``import debug_gym.gym.envs`` drags in
   although mini_nightmare never uses it (litellm, modal, tree-sitter, ... see ``IMPORT_DEPS``),
   plus pandas and pytest for the tasks' tests (the terminal runs this venv's ``python``).

Location: ``$LEYLINE_CACHE/debug-gym-1.3.0/venv`` (default cache ``~/.cache/leyline``). A stamp
file holds a hash of the package list; a changed list reinstalls into the same venv. A file lock
serialises concurrent first runs. ``ensure_venv`` also writes a small ``tree`` stand-in (the
``listdir`` tool shells out to ``tree``, which many machines lack).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from leyline_agent.cache import cache_root

DEBUG_GYM_VERSION = "1.3.0"
NO_DEPS: tuple[str, ...] = (f"debug-gym=={DEBUG_GYM_VERSION}", "swesmith==0.0.4", "swebench==4.0.3")
# debug-gym 1.3.0's Requires-Dist (swebench/swesmith excluded: installed without their deps).
RUNTIME_DEPS: tuple[str, ...] = (
    "datasets==3.6.0",
    "openai==1.99.9",
    "azure-identity==1.22.0",
    "tenacity==9.1.2",
    "pyyaml==6.0.2",
    "pytest==8.3.5",
    "gitignore_parser==0.1.12",
    "termcolor==3.1.0",
    "transformers==4.51.3",
    "tiktoken==0.14.0",
    "docker==7.1.0",
    "prompt_toolkit==3.0.51",
    "anthropic==0.51.0",
    "jinja2==3.1.6",
    "rich==14.0.0",
    "kubernetes==33.1.0",
)
# Imported by ``debug_gym.gym.envs`` (swe-bench/swe-smith modules) at import time.
IMPORT_DEPS: tuple[str, ...] = (
    "litellm==1.80.0",
    "python-dotenv==1.2.4",
    "tqdm==4.70.1",
    "unidiff==1.0.1",
    "astor==0.8.1",
    "tree-sitter==0.26.1",
    "tree-sitter-go==0.25.0",
    "ghapi==2.1.4",
    "requests==2.34.2",
    "beautifulsoup4==4.15.0",
    "chardet==7.7.0",
    "GitPython==3.2.1",
    "modal==1.6.4",  # swebench/__init__ imports its modal harness
)
TASK_DEPS: tuple[str, ...] = ("pandas==3.1.1",)
CHECK_IMPORTS = "import debug_gym.gym.envs, debug_gym.llms, debug_gym.agents, pandas, pytest"

Log = Callable[[str], None]


class DebugGymVenv(NamedTuple):
    """A ready debug-gym environment: ``python`` runs the driver, ``bin_dir`` goes first on the
    terminal's PATH, ``shim_dir`` (may be empty) holds stand-ins for missing programs."""

    root: Path
    python: Path
    bin_dir: Path
    shim_dir: Path


class VenvError(RuntimeError):
    """The debug-gym environment could not be created; the message says which step failed."""


def default_venv_dir() -> Path:
    return cache_root() / f"debug-gym-{DEBUG_GYM_VERSION}" / "venv"


def requirements_key() -> str:
    """Hash of every package spec; changes when a pin does."""
    text = "\n".join((*NO_DEPS, *RUNTIME_DEPS, *IMPORT_DEPS, *TASK_DEPS, _TREE_SHIM))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def find_python312() -> str:
    """A Python 3.12 interpreter: this one's base, ``$LEYLINE_PYTHON``, pyenv's or PATH's.

    Raises:
        VenvError: none found.
    """
    if os.environ.get("LEYLINE_PYTHON"):
        return os.environ["LEYLINE_PYTHON"]
    if sys.version_info[:2] == (3, 12):
        return getattr(sys, "_base_executable", None) or sys.executable
    pyenv = shutil.which("pyenv")
    if pyenv:
        root = subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip()
        found = sorted(Path(root, "versions").glob("3.12.*"), key=lambda p: p.name)
        for p in reversed(found):
            if (p / "bin" / "python").is_file():
                return str(p / "bin" / "python")
    for name in ("python3.12", "python3"):
        exe = shutil.which(name)
        if exe and _is_312(exe):
            return exe
    raise VenvError("Python 3.12 not found: install it or set LEYLINE_PYTHON")


def _is_312(exe: str) -> bool:
    code = "import sys; sys.exit(sys.version_info[:2] != (3, 12))"
    return subprocess.run([exe, "-c", code], capture_output=True).returncode == 0


def _run(argv: list[str], what: str, log: Log) -> None:
    log(f"debug-gym venv: {what}")
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-25:])
        raise VenvError(f"{what} failed ({r.returncode}):\n{tail}")


def _layout(root: Path) -> DebugGymVenv:
    return DebugGymVenv(root, root / "bin" / "python", root / "bin", root / "leyline-shims")


def ensure_venv(root: Path | None = None, *, log: Log = lambda _: None) -> DebugGymVenv:
    """Create (first time: about a minute of installs) or reuse debug-gym's venv.

    Raises:
        VenvError: no Python 3.12, or a pip step or the import check failed (with pip's tail).
    """
    root = Path(root) if root is not None else default_venv_dir()
    venv = _layout(root)
    stamp = root / ".leyline-installed"
    key = requirements_key()
    if stamp.is_file() and stamp.read_text().strip() == key and venv.python.is_file():
        return venv
    root.parent.mkdir(parents=True, exist_ok=True)
    with (root.parent / f".{root.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be installing it right now
        if stamp.is_file() and stamp.read_text().strip() == key and venv.python.is_file():
            return venv
        if not venv.python.is_file():
            _run([find_python312(), "-m", "venv", str(root)], f"create {root}", log)
        pip = [str(venv.python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run([*pip, "--no-deps", *NO_DEPS], "install debug-gym, swesmith, swebench (no deps)", log)
        _run(
            [*pip, *RUNTIME_DEPS, *IMPORT_DEPS, *TASK_DEPS],
            "install debug-gym's runtime dependencies, its import-time extras, pandas",
            log,
        )
        _run([str(venv.python), "-c", CHECK_IMPORTS], "check imports", log)
        write_tree_shim(venv.shim_dir)
        stamp.write_text(key + "\n")
    return venv


# The ``tree`` stand-in (``tree_shim.py``); its text is part of ``requirements_key``.
_TREE_SHIM = Path(__file__).with_name("tree_shim.py").read_text()


def write_tree_shim(directory: Path) -> Path:
    """Write ``directory/tree`` (run with whatever ``python3`` the terminal finds first)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tree"
    path.write_text("#!/usr/bin/env python3\n" + _TREE_SHIM)
    path.chmod(0o755)
    return path
