"""Launching ``leyline serve``: the SGLang command line it runs, and a process that runs it.

``server_command`` builds the ``python -m sglang.launch_server`` argv. On a host without CUDA it
serves on the CPU with ``--attention-backend leyline_cpu`` (``attention.py``: ``torch_native``
whose extend attends from the new tokens only, so an extend after a long cached prefix costs
``new x total``, not ``total x total``). Pass ``--attention-backend torch_native`` among the extra
arguments to get SGLang's own back (the last occurrence wins).

``EmbeddedServer`` starts and stops a ``leyline serve`` process (tests, ``leyline replay``,
``leyline bench``, ``leyline eval debug-gym`` without ``--backend``); ``wait_healthy`` is its wait
for ``/health``, shared with the tests and benches that start a server or proxy themselves. Pure
Python (httpx + subprocess; no sglang import here), so the agent side imports this module on a
core install; the server process itself needs the sglang extra.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import httpx

from leyline_agent.backends.sglang.pins import ENV_MAX_PINNED_FRACTION

# NOTE: two embedded-model contexts (131,072 tokens each, embedded/model.py); an MLA row of the
# embedded model is (64 + 16) x 2 bytes x 2 layers = 320 bytes, so the pool is about 80 MiB.
DEFAULT_MAX_TOTAL_TOKENS = 262144
# NOTE: SGLang's request table is [max_running_requests, context + 4] int32: at its CPU default
# (2048 requests) and a 131,072-token context that is 1 GiB; 64 requests keep it at 32 MiB.
CPU_MAX_RUNNING_REQUESTS = 64


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def server_command(
    model_path: Path,
    *,
    port: int,
    host: str = "127.0.0.1",
    dummy: bool,
    dtype: str | None,
    max_total_tokens: int | None,
    extra: list[str],
    cpu: bool,
    api_key: str | None = None,
    max_pinned_fraction: float | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The ``python -m sglang.launch_server`` argv and the environment to run it with.

    ``max_pinned_fraction``: the cap on pinned KV (``pins.py``), passed to the schedulers as
    ``LEYLINE_MAX_PINNED_FRACTION``.

    ``api_key``: SGLang's ``--api-key``: every route (the plugin's ``/leyline/*`` included) but
    ``/health*``, ``/ready*`` and ``/metrics*`` then needs ``Authorization: Bearer <key>``.
    """
    argv = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model_path),
        "--host", host,
        "--port", str(port),
        "--radix-cache-backend", "leyline",
        "--enable-cache-report",
        "--disable-overlap-schedule",
        "--tool-call-parser", "qwen25",
    ]  # fmt: skip
    if dummy:
        argv += ["--load-format", "dummy"]
    if dtype:
        argv += ["--dtype", dtype]
    if max_total_tokens:
        argv += ["--max-total-tokens", str(max_total_tokens)]
    if api_key:
        argv += ["--api-key", api_key]
    env = dict(os.environ)
    if max_pinned_fraction is not None:
        env[ENV_MAX_PINNED_FRACTION] = str(max_pinned_fraction)
    if cpu:
        argv += [
            "--device", "cpu",
            "--attention-backend", "leyline_cpu",
            "--disable-cuda-graph",
            "--sleep-on-idle",
        ]  # fmt: skip
        env["LEYLINE_CPU_DEV"] = "1"
        env.setdefault("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python")
        # One intra-op thread: the embedded model's ops are small, and with more OpenMP threads
        # than idle cores every op waits on spinning peers (measured: a 4k-row δ-rotation took
        # 200 ms with 2 threads on a loaded 2-core host, 2 ms with 1). Override with the env var.
        env.setdefault("OMP_NUM_THREADS", "1")
        ranks = cpu_rank_count(extra)
        if ranks > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in env:
            env["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(ranks)
    argv += extra
    return argv, env


def cpu_rank_count(extra: list[str]) -> int:
    """Scheduler processes SGLang starts for ``extra``: dp x tp x pp (the last flag wins)."""
    sizes = {"dp": 1, "tp": 1, "pp": 1}
    names = {f"--{k}{s}": k for k in sizes for s in ("", "-size")}
    for i, arg in enumerate(extra):
        flag, eq, val = arg.partition("=")
        if flag in names:
            val = val if eq else (extra[i + 1] if i + 1 < len(extra) else "1")
            if val.isdigit():
                sizes[names[flag]] = int(val)
    return sizes["dp"] * sizes["tp"] * sizes["pp"]


def cpu_threads_bind(ranks: int) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``ranks`` CPU schedulers: this process's cores cut into
    one contiguous range per rank (``"0-7|8-15"``; fewer cores than ranks: one core each, shared).
    SGLang's default binds one NUMA node per rank and refuses more ranks than NUMA nodes."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores = cores or list(range(os.cpu_count() or 1))
    per = len(cores) // ranks
    if per == 0:
        return "|".join(str(cores[r % len(cores)]) for r in range(ranks))
    chunks = [cores[r * per : (r + 1) * per] for r in range(ranks)]
    return "|".join(f"{c[0]}-{c[-1]}" if len(c) > 1 else str(c[0]) for c in chunks)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerError(RuntimeError):
    """The server did not come up; the message carries the tail of its log."""


def read_tail(path: Path, n: int = 40) -> str:
    """The last ``n`` lines of the log at ``path`` ("" when unreadable), without the long
    ``server_args=`` line SGLang prints at start."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(ln for ln in lines[-n:] if "server_args=" not in ln)


def wait_healthy(
    url: str,
    proc: subprocess.Popen[bytes],
    timeout: float,
    *,
    name: str = "server",
    log_tail: Callable[[], str] | None = None,
    poll_s: float = 1.0,
    on_poll: Callable[[float], None] | None = None,
) -> None:
    """Wait until ``url + "/health"`` answers 200 while ``proc`` (the process serving it) runs.

    ``name`` opens the error message; ``log_tail`` (when given) is called for the text that ends
    it (the process's log tail). ``on_poll`` (when given) is called before every check with the
    seconds waited so far (a progress line). ``proc`` is left as it is on failure: stopping it
    is the caller's.

    Raises:
        ServerError: ``proc`` exited (with its exit code) or ``/health`` did not answer 200
            within ``timeout`` seconds.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout
    while True:
        if on_poll is not None:
            on_poll(time.monotonic() - t0)
        if proc.poll() is not None:
            problem = f"{name} exited ({proc.returncode})"
            break
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() >= deadline:
            problem = f"{name} not ready after {timeout:.0f}s"
            break
        time.sleep(poll_s)
    tail = log_tail() if log_tail is not None else ""
    raise ServerError(f"{problem}:\n{tail}" if tail else problem)


class EmbeddedServer:
    """``with EmbeddedServer() as srv: httpx.get(srv.url + "/health")``.

    Runs ``leyline serve`` (the embedded default model unless ``model_path``) on a free loopback
    port, waits until ``/health`` answers (up to ``timeout`` seconds), and kills it on exit.
    ``max_total_tokens``: the KV pool in tokens. ``api_key``: the server requires it
    (``leyline serve --api-key``; ``/health`` stays open).

    Raises:
        ServerError: the process exited or did not answer in time (with its log tail).
    """

    def __init__(
        self,
        *,
        model_path: Path | None = None,
        port: int | None = None,
        max_total_tokens: int = DEFAULT_MAX_TOTAL_TOKENS,
        extra_args: list[str] | None = None,
        timeout: float = 600.0,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.timeout = timeout
        self.log_path = Path(tempfile.mkstemp(prefix="leyline-serve-", suffix=".log")[1])
        self.argv = [
            sys.executable, "-m", "leyline_agent.cli", "serve",
            "--port", str(self.port),
            "--max-total-tokens", str(max_total_tokens),
        ]  # fmt: skip
        if model_path is not None:
            self.argv += ["--model-path", str(model_path)]
        self.argv += extra_args or []
        self.api_key = api_key
        self.env = {**os.environ, **(env or {})}
        if api_key:  # NOTE: through the environment, not argv (leyline serve reads it)
            self.env["LEYLINE_SERVE_API_KEY"] = api_key
        else:
            self.env.pop("LEYLINE_SERVE_API_KEY", None)
        self.proc: subprocess.Popen[bytes] | None = None

    def log_tail(self, n: int = 40) -> str:
        return read_tail(self.log_path, n)

    def phase(self) -> str:
        """What the server is doing, read from its log: the message of its last SGLang line
        (``[date time] message``; warnings and tracebacks skipped), "starting Python" before
        the first."""
        for line in reversed(read_tail(self.log_path, 20).splitlines()):
            if line.startswith("[20") and "] " in line:
                return line.split("] ", 1)[1].strip()
        return "starting Python"

    def start(self, on_poll: Callable[[float], None] | None = None) -> EmbeddedServer:
        """Start the process (its output to ``log_path``) and wait for ``/health``; ``on_poll``:
        called about once a second with the seconds waited (see ``wait_healthy``)."""
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        try:
            wait_healthy(
                self.url, self.proc, self.timeout, name="leyline serve", log_tail=self.log_tail,
                on_poll=on_poll,
            )  # fmt: skip
        except BaseException:  # NOTE: Ctrl-C while it starts too: never leave it running
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
