"""The OpenAI-compatible Leyline proxy (``leyline proxy``); see ``docs/proxy.md``.

Needs fastapi and uvicorn (core dependencies). ``create_app(backend_url, policy)`` builds the app
(``app.py``; the streamed answers in ``relay.py``); ``SessionRegistry`` maps requests to sessions
(``sessions.py``, their keys in ``identity.py``); ``metrics.render`` formats ``GET /metrics``;
``TraceRecorder`` (``leyline_agent.traces.recorder``) writes ``--record``.
"""

from __future__ import annotations

from leyline_agent.proxy.app import create_app
from leyline_agent.proxy.identity import SESSION_HEADER
from leyline_agent.proxy.sessions import SessionRegistry
from leyline_agent.traces.recorder import TraceRecorder

__all__ = ["SESSION_HEADER", "SessionRegistry", "TraceRecorder", "create_app"]
