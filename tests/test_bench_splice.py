"""`leyline bench splice`: the spec, the medians, /proc memory, and the real CLI against a real
``leyline serve`` (the ``leyline_server`` fixture) at tiny lengths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from leyline_agent.bench.splice import (
    ProcMemory,
    SpliceBenchSpec,
    Trial,
    process_memory,
    summarize,
)
from leyline_agent.commands.bench import _lengths


def test_lengths_and_spec() -> None:
    assert _lengths("1k, 4k,256") == [1024, 4096, 256]
    assert SpliceBenchSpec(lengths=[4096, 1024]).lengths == [1024, 4096]
    with pytest.raises(ValueError, match="distinct"):
        SpliceBenchSpec(lengths=[512, 512])
    with pytest.raises(ValueError, match="inside the shortest length"):
        SpliceBenchSpec(lengths=[32, 1024]).check()
    with pytest.raises(ValueError, match="empty"):
        SpliceBenchSpec(edit_start=48, edit_end=48).check()


def _trial(length: int, rep: int, splice_ms: float, reprefill_ms: float) -> Trial:
    return Trial(
        length=length, repeat=rep, spliced_length=length - 24, prefilled=8,
        rotated=length - 48, splice_ms=splice_ms, splice_server_ms=splice_ms / 2,
        timings_ms={"prefill": 1.0, "rotate": 2.0 * rep, "tree": 0.5}, next_ms=10.0,
        next_prompt=length - 20, next_cached=length - 24, reprefill_ms=reprefill_ms,
        reprefill_cached=0,
        memory={
            "splice": {"scheduler_hwm_kib": 100 + rep}, "reprefill": {"scheduler_hwm_kib": 900}
        },
    )  # fmt: skip


def test_summary_takes_medians() -> None:
    trials = [_trial(1024, r, ms, 300.0 + r) for r, ms in enumerate((30.0, 10.0, 20.0))]
    s = summarize(trials)["1024"]
    assert s["splice_ms"] == 20.0 and s["splice_total_ms"] == 30.0
    assert s["reprefill_ms"] == 301.0 and s["speedup"] == pytest.approx(301.0 / 30.0)
    assert s["splice_timings_ms"] == {"prefill": 1.0, "rotate": 2.0, "tree": 0.5}
    assert s["splice_hit"]
    assert (s["memory"]["splice_peak_kib"], s["memory"]["reprefill_peak_kib"]) == (102, 900)


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs Linux /proc")
def test_process_memory_reads_proc() -> None:
    # NOTE: a process of our own: the test session's server may be a child of this one
    with subprocess.Popen(["sleep", "30"]) as child:
        try:
            m = process_memory(child.pid)
        finally:
            child.kill()
    assert m["source"] == "/proc" and m["processes"] >= 1 and m["total_rss_kib"] > 0
    assert m["scheduler_hwm_kib"] is None  # no sglang scheduler below that process
    probe = ProcMemory(os.getpid())
    probe.reset()
    assert probe.read()["hwm_reset"] is True and probe.read()["total_rss_kib"] > 0


@pytest.mark.sglang
@pytest.mark.timeout(300)
def test_bench_splice_cli(leyline_server: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable, "-m", "leyline_agent.cli", "bench", "splice",
            "--backend", leyline_server, "--lengths", "256,512", "--repeats", "1",
            "--out", str(out),
        ],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(doc["lengths"]) == {"256", "512"}
    for length, s in doc["lengths"].items():
        spliced = int(length) - (48 - 16) + 8
        assert s["spliced_length"] == spliced and s["prefilled"] == 8, length
        assert s["rotated"] == int(length) - 48, length
        assert s["next_cached"] == spliced and s["splice_hit"], length  # the splice hit in full
        assert s["next_prompt"] == spliced + 4 and s["reprefill_cached"] == 0, length
        for key in ("splice_ms", "splice_server_ms", "next_ms", "splice_total_ms", "reprefill_ms"):
            assert s[key] > 0, (length, key)
        assert s["speedup"] > 0
        for phase in ("splice", "reprefill"):  # --backend: the pool counters, no process memory
            stats = s["memory"]["last"][phase]
            assert stats["source"] == "/leyline/stats" and stats["ok"], (length, phase)
    results = json.loads((out / "results.json").read_text())
    assert len(results["trials"]) == 2 and results["environment"]["versions"]["sglang"]
    assert (out / "splice.png").read_bytes()[:4] == b"\x89PNG"
