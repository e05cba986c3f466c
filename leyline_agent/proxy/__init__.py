"""The OpenAI-compatible Leyline proxy (``leyline proxy``); see ``docs/proxy.md``.

Needs fastapi and uvicorn (core dependencies). ``create_app(backend_url, policy)`` builds the app;
``SessionRegistry`` maps requests to sessions; ``metrics.render`` formats ``GET /metrics``.
"""

from __future__ import annotations

from leyline_agent.proxy.app import create_app
from leyline_agent.proxy.sessions import SESSION_HEADER, SessionRegistry, TraceRecorder

__all__ = ["SESSION_HEADER", "SessionRegistry", "TraceRecorder", "create_app"]
