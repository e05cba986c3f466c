"""``leyline bench splice``: a splice plus the next request vs re-prefilling the edited sequence.

Per length ``L`` and repeat, in a fresh namespace (``extra_key``) each:

1. setup (not timed): ``/generate`` with ``L`` random token ids, one output token, so the radix
   tree holds the sequence;
2. (a) ``POST /leyline/splice`` with one AMORTIZE directive near the start (default: replace
   ``[16, 48)`` with 8 tokens), then ``/generate`` with the edited sequence plus a few new tokens;
   the request should find the whole edited sequence cached;
3. (b) ``/generate`` with the same request in another fresh namespace: a cold prefill of
   everything, what an engine without an edit channel does after an edit near the start.

Times are client-side wall times in milliseconds (HTTP included), medians over the repeats. The
splice breakdown (``prefill``, ``rotate``, ``tree``) is the server's ``timings_ms`` when it reports
one. Memory is the server processes' resident set read from ``/proc`` when this process started
the server (Linux only), otherwise the KV-pool counters of ``/leyline/stats``.

Pure Python (httpx, rich; matplotlib for the plot); the backend is any ``leyline serve``.
"""

from __future__ import annotations

import json
import random
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator
from rich.table import Table

from leyline_agent.client import LeylineClient, SpliceRejected
from leyline_agent.directive import Directive, Mode

DEFAULT_LENGTHS = (1024, 4096, 16384, 32768)
TOKEN_RANGE = (1000, 30000)  # ids every common vocabulary has, none of them special
MEMORY_NOTE = (
    "peak RSS: VmHWM of the server's sglang::scheduler process (model, KV pool, request table and "
    "activations live there), reset (/proc/<pid>/clear_refs) before each phase and read after it, "
    "so it is the process's whole resident set at its highest during the phase (weights and "
    "runtime included), not the phase's own allocation; maximum over the repeats"
)


class SpliceBenchSpec(BaseModel):
    """What to measure (the CLI's options; recorded in ``results.json``).

    lengths: cached sequence lengths ``L`` in tokens.
    repeats: trials per length; the report gives medians.
    edit_start, edit_end: the replaced span ``[start, end)`` of the cached sequence.
    replacement: tokens of the replacement.
    new_tokens: tokens appended after the edited sequence in the next request.
    seed: seeds the token ids.
    """

    model_config = ConfigDict(frozen=True)

    lengths: list[int] = Field(default_factory=lambda: list(DEFAULT_LENGTHS), min_length=1)
    repeats: int = Field(default=3, ge=1)
    edit_start: int = Field(default=16, ge=0)
    edit_end: int = 48
    replacement: int = Field(default=8, ge=0)
    new_tokens: int = Field(default=4, ge=1)
    seed: int = 0
    backend: str | None = None

    @field_validator("lengths")
    @classmethod
    def _sorted_unique(cls, lengths: list[int]) -> list[int]:
        if len(set(lengths)) != len(lengths) or any(n < 1 for n in lengths):
            raise ValueError(f"lengths must be distinct positive integers, got {lengths}")
        return sorted(lengths)

    def check(self) -> None:
        """Raises ``ValueError`` when the edit does not fit the shortest length."""
        if not self.edit_start < self.edit_end:
            raise ValueError(f"edit [{self.edit_start}, {self.edit_end}) is empty")
        if self.edit_end >= self.lengths[0]:
            raise ValueError(
                f"edit end {self.edit_end} must lie inside the shortest length {self.lengths[0]}"
            )


class Trial(BaseModel):
    """One repeat at one length (times in milliseconds, client-side wall time).

    splice_ms: the splice call; splice_server_ms: the server's own ``elapsed_ms``;
    timings_ms: the server's breakdown (empty when it reports none).
    next_ms: the request after the splice; next_cached: its cached tokens (== spliced_length on a
    hit). reprefill_ms / reprefill_cached: the same request in a cold namespace.
    memory: the probe's reading after each phase, ``{"splice": {...}, "reprefill": {...}}``.
    """

    length: int
    repeat: int
    spliced_length: int
    prefilled: int
    rotated: int
    splice_ms: float
    splice_server_ms: float
    timings_ms: dict[str, float]
    next_ms: float
    next_prompt: int
    next_cached: int
    reprefill_ms: float
    reprefill_cached: int
    memory: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @property
    def splice_total_ms(self) -> float:
        return self.splice_ms + self.next_ms


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


def splice_raw(
    client: LeylineClient, tokens: Sequence[int], directive: Directive, extra_key: str
) -> tuple[dict[str, Any], float]:
    """``POST /leyline/splice``; returns the response body (with ``timings_ms`` when the server
    sends it, which ``LeylineClient.splice`` drops) and the wall time in ms.

    Raises:
        SpliceRejected: any status but 200.
    """
    body = {
        "tokens": list(tokens),
        "directives": [directive.model_dump(mode="json")],
        "extra_key": extra_key,
    }
    t0 = time.perf_counter()
    r = client.http.post("/leyline/splice", json=body)
    ms = (time.perf_counter() - t0) * 1e3
    if r.status_code != 200:
        raise SpliceRejected(r.status_code, r.text[:500])
    return r.json(), ms


def run_trial(
    client: LeylineClient,
    spec: SpliceBenchSpec,
    length: int,
    repeat: int,
    run_id: str,
    probe: MemoryProbe | None = None,
) -> Trial:
    """Setup, (a) splice + next request, (b) cold re-prefill; see the module docstring. The probe
    is reset before and read after each of (a) and (b)."""
    probe = probe or NoMemory()
    rng = random.Random(f"{spec.seed}:{length}:{repeat}")
    tokens = _ids(rng, length)
    repl = _ids(rng, spec.replacement)
    tail = _ids(rng, spec.new_tokens)
    ns = f"bench-splice:{run_id}:{length}:{repeat}"
    client.generate(tokens, extra_key=ns, max_new_tokens=1)

    d = Directive(start=spec.edit_start, end=spec.edit_end, replacement=repl, mode=Mode.AMORTIZE)
    edited = tokens[: spec.edit_start] + repl + tokens[spec.edit_end :]
    probe.reset()
    res, splice_ms = splice_raw(client, tokens, d, ns)
    nxt = client.generate(edited + tail, extra_key=ns, max_new_tokens=1)
    mem_splice = probe.read()
    probe.reset()
    cold = client.generate(edited + tail, extra_key=f"{ns}:cold", max_new_tokens=1)
    mem_cold = probe.read()
    return Trial(
        length=length,
        repeat=repeat,
        spliced_length=int(res["new_length"]),
        prefilled=int(res["prefilled"]),
        rotated=int(res["rotated"]),
        splice_ms=splice_ms,
        splice_server_ms=float(res["elapsed_ms"]),
        timings_ms={k: float(v) for k, v in (res.get("timings_ms") or {}).items()},
        next_ms=nxt.e2e_ms,
        next_prompt=nxt.prompt_tokens,
        next_cached=nxt.cached_tokens,
        reprefill_ms=cold.e2e_ms,
        reprefill_cached=cold.cached_tokens,
        memory={"splice": mem_splice, "reprefill": mem_cold},
    )


def run(
    spec: SpliceBenchSpec,
    client: LeylineClient,
    *,
    probe: MemoryProbe | None = None,
    log: Callable[[str], None] = lambda _line: None,
    warmup: bool = True,
) -> list[Trial]:
    """Every (length, repeat) trial, lengths in increasing order. A warmup trial at the shortest
    length runs first and is not recorded.

    Raises:
        ValueError: the edit does not fit (``spec.check``).
        SpliceRejected, httpx.HTTPError: the backend refused or failed a request.
    """
    spec.check()
    run_id = uuid.uuid4().hex[:8]
    if warmup:
        run_trial(client, spec, spec.lengths[0], -1, run_id)
    trials: list[Trial] = []
    for length in spec.lengths:
        for rep in range(spec.repeats):
            t = run_trial(client, spec, length, rep, run_id, probe)
            trials.append(t)
            log(
                f"L={length} repeat {rep + 1}/{spec.repeats}: splice+next "
                f"{t.splice_total_ms:.0f} ms, re-prefill {t.reprefill_ms:.0f} ms, "
                f"cached {t.next_cached}/{t.next_prompt}"
            )
    return trials


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


def _peak(ts: Sequence[Trial], phase: str) -> int | None:
    vals = [t.memory.get(phase, {}).get("scheduler_hwm_kib") for t in ts]
    return max((v for v in vals if v), default=None)


def summarize(trials: Sequence[Trial]) -> dict[str, dict[str, Any]]:
    """``{str(L): medians}``; ``speedup = reprefill_ms / (splice_ms + next_ms)``; ``memory``:
    peak scheduler RSS per phase (max over repeats) and the last reading of each phase."""
    out: dict[str, dict[str, Any]] = {}
    for length in sorted({t.length for t in trials}):
        ts = [t for t in trials if t.length == length]
        keys = sorted({k for t in ts for k in t.timings_ms})
        total = _median([t.splice_total_ms for t in ts])
        reprefill = _median([t.reprefill_ms for t in ts])
        out[str(length)] = {
            "repeats": len(ts),
            "spliced_length": ts[0].spliced_length,
            "prefilled": ts[0].prefilled,
            "rotated": ts[0].rotated,
            "splice_ms": _median([t.splice_ms for t in ts]),
            "splice_server_ms": _median([t.splice_server_ms for t in ts]),
            "splice_timings_ms": {k: _median([t.timings_ms.get(k, 0.0) for t in ts]) for k in keys},
            "next_ms": _median([t.next_ms for t in ts]),
            "splice_total_ms": total,
            "reprefill_ms": reprefill,
            "speedup": reprefill / total if total else None,
            "next_prompt": ts[0].next_prompt,
            "next_cached": min(t.next_cached for t in ts),
            "splice_hit": all(t.next_cached == t.spliced_length for t in ts),
            "reprefill_cached": max(t.reprefill_cached for t in ts),
            "memory": {
                "splice_peak_kib": _peak(ts, "splice"),
                "reprefill_peak_kib": _peak(ts, "reprefill"),
                "last": ts[-1].memory,
            },
        }
    return out


def _mib(kib: int | None) -> str:
    return f"{kib / 1024:,.0f}" if kib else "-"


def table(summary: dict[str, dict[str, Any]], spec: SpliceBenchSpec) -> Table:
    edit = f"[{spec.edit_start}, {spec.edit_end}) -> {spec.replacement} tokens"
    t = Table(
        title=f"leyline bench splice (edit {edit}; medians of {spec.repeats})",
        caption="splice+next: the splice call and the request after it; re-prefill: the same "
        "request cold. " + MEMORY_NOTE,
    )
    for col in ("L", "splice ms", "prefill/rotate/tree", "next ms", "splice+next"):
        t.add_column(col, justify="right", no_wrap=True)
    for col in ("re-prefill ms", "speedup", "cached", "peak RSS MiB splice/re-prefill"):
        t.add_column(col, justify="right", no_wrap=True)
    for length, s in summary.items():
        tm = s["splice_timings_ms"]
        parts = "/".join(f"{tm[k]:.1f}" for k in ("prefill", "rotate", "tree") if k in tm)
        t.add_row(
            f"{int(length):,}",
            f"{s['splice_ms']:.1f}",
            parts or "-",
            f"{s['next_ms']:.1f}",
            f"{s['splice_total_ms']:.1f}",
            f"{s['reprefill_ms']:.1f}",
            f"{s['speedup']:.1f}x" if s["speedup"] else "-",
            f"{s['next_cached']:,}/{s['next_prompt']:,}",
            f"{_mib(s['memory']['splice_peak_kib'])}/{_mib(s['memory']['reprefill_peak_kib'])}",
        )
    return t


def plot(out: Path, summary: dict[str, dict[str, Any]], spec: SpliceBenchSpec) -> Path:
    """``out/splice.png``: latency against L (left), the splice broken down (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    lengths = [int(n) for n in summary]
    rows = list(summary.values())
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9.5, 3.8))
    ax.plot(lengths, [s["reprefill_ms"] for s in rows], "o-", color="#d62728", label="re-prefill")
    ax.plot(lengths, [s["splice_total_ms"] for s in rows], "o-", color="#1f77b4",
            label="splice + next request")  # fmt: skip
    ax.plot(lengths, [s["splice_ms"] for s in rows], "o--", color="#1f77b4", alpha=0.6,
            label="splice call alone")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.set_xticks(lengths, [f"{n // 1024}k" if n >= 1024 else str(n) for n in lengths])
    ax.set_xlabel("cached sequence length L (tokens)")
    ax.set_ylabel("median wall time, ms")
    ax.set_title("edit near the start: splice vs re-prefill", fontsize=9)
    ax.legend(fontsize=8)

    xs = range(len(lengths))
    keys = [
        k for k in ("prefill", "rotate", "tree") if any(k in s["splice_timings_ms"] for s in rows)
    ]
    bottom = [0.0] * len(rows)
    for k, color in zip(keys, ("#9ecae1", "#3182bd", "#08519c"), strict=False):
        vals = [s["splice_timings_ms"].get(k, 0.0) for s in rows]
        bx.bar(xs, vals, 0.6, bottom=bottom, label=k, color=color)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    rest = [max(0.0, s["splice_ms"] - b) for s, b in zip(rows, bottom, strict=True)]
    bx.bar(xs, rest, 0.6, bottom=bottom, label="HTTP + queue + other", color="#d9d9d9")
    bx.set_xticks(xs, [f"{n:,}" for n in lengths])
    bx.set_xlabel("L (tokens)")
    bx.set_ylabel("median splice call, ms")
    bx.set_title(f"splice call broken down ({spec.replacement}-token replacement)", fontsize=9)
    bx.legend(fontsize=8)
    fig.tight_layout()
    path = out / "splice.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_results(
    out: Path,
    spec: SpliceBenchSpec,
    summary: dict[str, dict[str, Any]],
    trials: Sequence[Trial],
    env: dict[str, Any],
) -> Path:
    """``out/results.json``: arguments, environment, medians per length, every trial."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "arguments": spec.model_dump(mode="json"),
        "environment": env,
        "memory_note": MEMORY_NOTE,
        "lengths": summary,
        "trials": [t.model_dump(mode="json") for t in trials],
    }
    path = out / "results.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


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
