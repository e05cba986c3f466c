"""Leyline: edit an LLM server's KV cache instead of re-prefilling.

Public API (pure Python; torch and sglang are only needed by ``leyline_agent.backends`` and
``leyline_agent.kernels``)::

    from leyline_agent import ConversationWrapper, Directive, LeylineSession, Mode
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from leyline_agent.directive import Directive, DirectiveError, Mode, apply_directives, plan_edit

__version__ = "0.1.0"

__all__ = [
    "ConversationWrapper",
    "Directive",
    "DirectiveError",
    "LeylineSession",
    "Mode",
    "__version__",
    "apply_directives",
    "plan_edit",
]

if TYPE_CHECKING:
    from leyline_agent.api import LeylineSession
    from leyline_agent.wrapper import ConversationWrapper


def __getattr__(name: str) -> Any:
    if name == "ConversationWrapper":
        from leyline_agent.wrapper import ConversationWrapper

        return ConversationWrapper
    if name == "LeylineSession":
        from leyline_agent.api import LeylineSession

        return LeylineSession
    raise AttributeError(f"module 'leyline_agent' has no attribute {name!r}")
