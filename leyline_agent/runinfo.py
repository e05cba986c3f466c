"""What every runner records beside its figures: machine, versions, commit, the backend.

``environment(backend)`` is the ``"environment"`` section of every ``results.json``
(``leyline replay``, ``leyline bench splice``, ``leyline eval debug-gym``, the fidelity
experiment). ``git_commit`` reads ``.git`` files (no git process, works in a worktree);
``backend_info`` asks a running backend what it serves.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx

VERSIONED = ("leyline-agent", "sglang", "torch", "transformers", "httpx", "pydantic", "tokenizers")


def _read_ref(root: Path, ref: str) -> str | None:
    if (root / ref).is_file():
        return (root / ref).read_text().strip()
    packed = root / "packed-refs"
    if packed.is_file():
        for line in packed.read_text().splitlines():
            if line.endswith(" " + ref) and not line.startswith(("#", "^")):
                return line.split()[0]
    return None


def git_commit(start: Path | None = None) -> str | None:
    """The HEAD commit of the checkout holding ``start`` (default: this package), read from
    ``.git``: a directory, or a ``gitdir: <path>`` file (worktree, submodule) whose
    ``commondir`` holds the shared refs; a loose ref before ``packed-refs``. None outside a
    checkout or when HEAD names a ref that does not exist."""
    here = (start or Path(__file__)).resolve()
    for d in (here, *here.parents):
        git = d / ".git"
        if git.is_file():
            git = (d / git.read_text().split(":", 1)[1].strip()).resolve()
        if not git.is_dir():
            continue
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head
        ref = head.split(":", 1)[1].strip()
        common = git / "commondir"
        roots = [git] + ([(git / common.read_text().strip()).resolve()] if common.is_file() else [])
        for root in roots:
            found = _read_ref(root, ref)
            if found is not None:
                return found
        return None
    return None


def version(dist: str) -> str | None:
    """The installed version of ``dist`` (None: not installed)."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }


def environment(
    backend: Mapping[str, Any] | None = None, versions: Mapping[str, str | None] | None = None
) -> dict[str, Any]:
    """``{"machine", "versions", "commit", "argv", "backend"}``; ``versions`` adds to (or
    overrides) the installed versions of ``VERSIONED``."""
    return {
        "machine": machine(),
        "versions": {**{d: version(d) for d in VERSIONED}, **(versions or {})},
        "commit": git_commit(),
        "argv": sys.argv,
        "backend": dict(backend) if backend is not None else None,
    }


# A busy CPU server answers its probes late: /leyline/stats waits for the scheduler's batch.
PROBE_TIMEOUTS = (10.0, 60.0, 120.0)


def _probe(http: httpx.Client, path: str) -> httpx.Response:
    """GET ``path``, a timed-out attempt retried with the next of ``PROBE_TIMEOUTS`` (seconds).

    Raises:
        httpx.HTTPError: the last attempt failed (a timeout after all of them, or any other).
    """
    for timeout in PROBE_TIMEOUTS[:-1]:
        try:
            return http.get(path, timeout=timeout)
        except httpx.TimeoutException:
            continue
    return http.get(path, timeout=PROBE_TIMEOUTS[-1])


def backend_info(http: httpx.Client) -> dict[str, Any]:
    """What the backend at ``http.base_url`` serves: ``url``, SGLang's ``/get_model_info``
    (``model_path``, ``load_format``: ``"dummy"`` for random weights, ``model_type``; or
    ``model_info_error``) and ``leyline`` (it answers ``/leyline/stats``: it can splice; False
    with ``leyline_error`` when the probe failed). A probe that times out is retried with longer
    timeouts (``PROBE_TIMEOUTS``): a loaded server is slow, not a different server (a 10 s
    timeout once skipped a run's splice arm here, at load 16 on 2 cores)."""
    info: dict[str, Any] = {"url": str(http.base_url).rstrip("/")}
    try:
        r = _probe(http, "/get_model_info")
        r.raise_for_status()
        data = r.json()
        info.update({k: data.get(k) for k in ("model_path", "load_format", "model_type")})
    except (httpx.HTTPError, ValueError) as e:
        info["model_info_error"] = repr(e)
    try:
        info["leyline"] = _probe(http, "/leyline/stats").status_code == 200
    except httpx.HTTPError as e:
        info["leyline"] = False
        info["leyline_error"] = repr(e)
    return info
