"""CPU dev mode: the two patches SGLang 0.5.23 needs to serve a DeepSeek-V2 model without CUDA.

Only applied by :func:`apply` when the host has no CUDA (``leyline serve`` sets
``LEYLINE_CPU_DEV=1`` there). Observed on SGLang 0.5.23 (see ``shared/SGLANG_NOTES.md``):

1. ``sglang.srt.layers.rotary_embedding.base._is_cpu`` must be True before a ``RotaryEmbedding``
   is built, or its constructor imports vllm's CUDA ops ("No module named 'vllm'").
2. The ``torch_native`` attention backend has no DeepSeek forward-method handler; without one the
   model falls back to the MHA prefill path and warm-up crashes with a shape mismatch. We map it to
   the absorbed MLA path (``AttnForwardMethod.MLA``), which is what the KV cache layout
   ``[c_kv | k_pe]`` is built for. ``leyline serve`` uses ``leyline_cpu`` (``attention.py``) on
   CPU, which maps its own name the same way when it is built; this mapping keeps
   ``--attention-backend torch_native`` working too.
"""

from __future__ import annotations

import os


def enabled() -> bool:
    """True when ``LEYLINE_CPU_DEV`` is set to 1 (``leyline serve`` sets it on CUDA-less hosts)."""
    return os.environ.get("LEYLINE_CPU_DEV", "0") == "1"


def patch_rotary_embedding_is_cpu() -> None:
    from leyline_agent.backends.sglang.compat import rotary_embedding_base as rope_base

    rope_base._is_cpu = True


def register_torch_native_mla_handler() -> None:
    from leyline_agent.backends.sglang.compat import AttentionBackendRegistry, AttnForwardMethod

    AttentionBackendRegistry.register("torch_native", lambda *args: AttnForwardMethod.MLA)


def apply() -> None:
    """Apply both patches (idempotent)."""
    patch_rotary_embedding_is_cpu()
    register_torch_native_mla_handler()
