"""Build the SGLang command line that ``leyline serve`` runs.

On a host without CUDA it serves on the CPU with ``--attention-backend leyline_cpu``
(``attention.py``: ``torch_native`` whose extend attends from the new tokens only, so an extend
after a long cached prefix costs ``new x total``, not ``total x total``). Pass
``--attention-backend torch_native`` among the extra arguments to get SGLang's own back (the last
occurrence wins).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


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
) -> tuple[list[str], dict[str, str]]:
    """The ``python -m sglang.launch_server`` argv and the environment to run it with.

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
    argv += extra
    return argv, env
