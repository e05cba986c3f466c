"""Server memory around each phase of ``leyline bench splice``: the resident set of the server's
processes from ``/proc`` (Linux, when this process started the server) or the KV-pool counters of
``/leyline/stats``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import httpx

from leyline_agent.client import LeylineClient

MEMORY_NOTE = (
    "peak RSS: VmHWM of the server's sglang::scheduler process (model, KV pool, request table and "
    "activations live there), reset (/proc/<pid>/clear_refs) before each phase and read after it, "
    "so it is the process's whole resident set at its highest during the phase (weights and "
    "runtime included), not the phase's own allocation; maximum over the repeats"
)


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _status_kib(pid: int) -> dict[str, int | str]:
    out: dict[str, int | str] = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "Name":
            out["name"] = value.strip()
        elif key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def process_memory(pid: int) -> dict[str, Any]:
    """RSS of ``pid`` and its descendants (``/proc/<pid>/status``, KiB). ``scheduler_*``: the
    process whose name starts with ``sglang::schedul`` (where the model and KV pool live)."""
    procs = {p: _status_kib(p) for p in _tree(pid)}
    sched = next(
        (s for s in procs.values() if str(s.get("name", "")).startswith("sglang::schedul")), {}
    )
    return {
        "source": "/proc",
        "scheduler_rss_kib": sched.get("VmRSS"),
        "scheduler_hwm_kib": sched.get("VmHWM"),
        "total_rss_kib": sum(int(s.get("VmRSS", 0)) for s in procs.values()),
        "processes": len(procs),
    }


def _tree(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    return seen


class MemoryProbe(Protocol):
    """Reset before a phase, read after it."""

    def reset(self) -> None: ...

    def read(self) -> dict[str, Any]: ...


class NoMemory:
    def reset(self) -> None:
        pass

    def read(self) -> dict[str, Any]:
        return {}


class ProcMemory:
    """The server's processes (this process started them): ``reset`` writes 5 to
    ``/proc/<pid>/clear_refs`` of each (Linux: VmHWM := VmRSS), ``read`` is
    :func:`process_memory`. A refused reset is recorded as ``hwm_reset: False`` (VmHWM is then the
    peak since the process started)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.reset_ok = True

    def reset(self) -> None:
        for p in _tree(self.pid):
            try:
                Path(f"/proc/{p}/clear_refs").write_text("5")
            except OSError:
                self.reset_ok = False

    def read(self) -> dict[str, Any]:
        return {**process_memory(self.pid), "hwm_reset": self.reset_ok}


class StatsMemory:
    """A server started elsewhere: the KV-pool counters of ``/leyline/stats`` (tokens), no
    process memory."""

    def __init__(self, client: LeylineClient):
        self.client = client

    def reset(self) -> None:
        pass

    def read(self) -> dict[str, Any]:
        try:
            return {"source": "/leyline/stats", **self.client.stats()}
        except httpx.HTTPError as e:  # a stats failure must not lose the timings
            return {"source": "/leyline/stats", "error": f"{type(e).__name__}: {e}"}
