"""Kernels: RoPE math (`rope`) and the δ-rotation of cached keys (`delta_rotation`: contract,
checks and dispatch; `delta_rotation_ref`: the torch reference; `delta_rotation_triton`).

Importing this package imports neither torch nor triton; names load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RopeBand": "rope",
    "RopeSpec": "rope",
    "inv_freq": "rope",
    "mla_band": "rope",
    "mscale": "rope",
    "rope_band": "rope",
    "rotate": "rope",
    "check_uniform_rope": "rope",
    "Rotation": "delta_rotation_ref",
    "delta_rotate": "delta_rotation",
    "delta_rotate_torch": "delta_rotation_ref",
    "delta_rotate_triton": "delta_rotation_triton",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'leyline_agent.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"leyline_agent.kernels.{module}"), name)
