"""``ScriptedFixLLM``: a test double for the LLM (not a model): an OpenAI-compatible endpoint that
stands between the Leyline proxy and a real ``leyline serve`` and answers with a script.

Every request is forwarded to the real server (chat completions, ``/leyline/splice``,
``/leyline/stats``, ``/get_model_info``, ``/v1/models``), so the proxy, its policy, the splices
and the engine's prefill all run for real; only the reply's ``message`` is replaced by the
script's next tool call (step ``k`` = the number of assistant messages in the request), because
random weights never write a fix.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from leyline_agent.backends.sglang.launch import free_port

ToolCall = tuple[str, dict[str, Any]]  # (tool name, arguments)


class ScriptedFixLLM:
    """Serve ``script`` (one tool call per agent step) in front of ``backend`` on a loopback port.

    ``calls`` counts the chat completions answered; ``url`` is the base URL (without ``/v1``).
    """

    def __init__(self, backend: str, script: Sequence[ToolCall]) -> None:
        self.backend = backend.rstrip("/")
        self.script = list(script)
        self.calls = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        route = Route("/{path:path}", self._forward, methods=["GET", "POST"])
        config = uvicorn.Config(
            Starlette(routes=[route]), host="127.0.0.1", port=self.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="scripted-llm", daemon=True)
        self.http = httpx.AsyncClient(base_url=self.backend, timeout=600)

    def scripted_message(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        step = sum(m.get("role") == "assistant" for m in messages)
        name, args = self.script[min(step, len(self.script) - 1)]
        call = {
            "id": f"call_scripted_{step}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)},
        }
        return {"role": "assistant", "content": f"Scripted step {step}.", "tool_calls": [call]}

    async def _forward(self, request: Request) -> Response:
        path = "/" + request.path_params["path"]
        body = await request.body()
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        r = await self.http.request(
            request.method, path, content=body or None, headers=headers, params=request.query_params
        )
        if path != "/v1/chat/completions" or r.status_code != 200:
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        reply = r.json()
        self.calls += 1
        message = self.scripted_message(json.loads(body)["messages"])
        reply["choices"][0].update(message=message, finish_reason="tool_calls")
        return JSONResponse(reply)

    def __enter__(self) -> ScriptedFixLLM:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"ScriptedFixLLM did not start on port {self.port}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
