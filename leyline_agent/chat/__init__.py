"""Chat-template helpers for ``leyline_agent.render``: the jinja2 environment transformers uses
(``template.py``) and SGLang's normalisation of requests before templating (``sglang.py``)."""

from __future__ import annotations

from leyline_agent.chat.sglang import sglang_messages, sglang_tools
from leyline_agent.chat.template import compile_template

__all__ = ["compile_template", "sglang_messages", "sglang_tools"]
