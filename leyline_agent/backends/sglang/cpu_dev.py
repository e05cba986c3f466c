"""CPU dev mode: the patches SGLang 0.5.23 needs to serve a DeepSeek-V2 model (or LoRA) without CUDA.

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
3. ``--tp-size`` > 1: SGLang decides "CPU" by ``SGLANG_USE_CPU_ENGINE=1`` (which breaks imports
   here), so ``init_model_parallel_group`` builds a ``PyNcclCommunicator`` for the TP group and
   fails ("Expected a cuda device, but got: cpu"). Without pynccl (and custom all-reduce) the
   group's collectives run on torch.distributed's gloo CPU group.
4. ``--enable-lora``: SGLang's LoRA layers and memory pool pin host buffers
   (``torch.tensor(..., pin_memory=True)``, ``Tensor.pin_memory()`` in ``sglang/srt/lora/
   layers.py``), which a CPU-only torch answers with "Found no NVIDIA driver". With no CUDA,
   pinning means nothing (there is no device copy to speed up): ``torch.tensor``/``empty``/
   ``zeros`` drop ``pin_memory=True`` and ``Tensor.pin_memory`` returns the tensor itself. Only
   when ``torch.cuda.is_available()`` is False, so a CUDA host never runs this.
"""

from __future__ import annotations

import os
from typing import Any


def enabled() -> bool:
    """True when ``LEYLINE_CPU_DEV`` is set to 1 (``leyline serve`` sets it on CUDA-less hosts)."""
    return os.environ.get("LEYLINE_CPU_DEV", "0") == "1"


def patch_rotary_embedding_is_cpu() -> None:
    from leyline_agent.backends.sglang.compat import rotary_embedding_base as rope_base

    rope_base._is_cpu = True


def register_torch_native_mla_handler() -> None:
    from leyline_agent.backends.sglang.compat import AttentionBackendRegistry, AttnForwardMethod

    AttentionBackendRegistry.register("torch_native", lambda *args: AttnForwardMethod.MLA)


def _no_pynccl(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    kwargs["use_pynccl"] = False
    kwargs["use_custom_allreduce"] = False
    return args, kwargs


def register_cpu_parallel_groups() -> None:
    from leyline_agent.backends.sglang.compat import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.distributed.parallel_state.init_model_parallel_group",
        _no_pynccl,
        HookType.BEFORE,
    )


def no_pin_memory() -> None:
    """Patch 4: pinning is a no-op on a CPU-only torch (idempotent; nothing on a CUDA host)."""
    import torch

    if torch.cuda.is_available() or getattr(torch.Tensor.pin_memory, "_leyline", False):
        return

    def unpinned(fn: Any) -> Any:
        def make(*args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        return make

    for name in ("tensor", "empty", "zeros"):
        setattr(torch, name, unpinned(getattr(torch, name)))

    def pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    pin_memory._leyline = True  # type: ignore[attr-defined]
    torch.Tensor.pin_memory = pin_memory


def apply() -> None:
    """Apply the patches (idempotent)."""
    patch_rotary_embedding_is_cpu()
    register_torch_native_mla_handler()
    register_cpu_parallel_groups()
    no_pin_memory()
