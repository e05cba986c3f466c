"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API through
the proxy, a thin adapter over the chat turn (request view → turn core → response view).

- The request becomes a chat-completions body (``chat.anthropic.chat_body``) and runs through
  ``chat.serve_turn``: the same session resolution, refusals before any splice, policy, diff,
  splice, pins (``cache_control`` breakpoints) and accounting as ``/v1/chat/completions``.
  ``AnthropicView`` answers in the Messages format: ``content`` blocks (``text``, ``tool_use``),
  ``stop_reason``, Anthropic's usage fields, errors as ``{"type": "error", "error": {...}}``, and
  streams as Anthropic's events (``message_start``, ``content_block_start``/``_delta``/``_stop``
  with ``text_delta`` and ``input_json_delta``, ``message_delta`` with the usage,
  ``message_stop``).
- Session keys: as on the OpenAI routes (``X-Leyline-Session``, then the body's keys); Claude
  Code's ``X-Claude-Code-Session-Id`` names the session where no ``X-Leyline-Session`` does;
  ``metadata.user_id`` is the end user's scope (``user``). The ``anthropic-version`` and
  ``anthropic-beta`` headers and query strings (``?beta=true``) are accepted.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any

import httpx
import jinja2
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from leyline_agent.chat.anthropic import (
    MessagesError,
    anthropic_usage,
    chat_body,
    content_blocks,
    error_body,
    error_kind,
    message_object,
    new_id,
)
from leyline_agent.chat.context_editing import applied_edits, context_policy
from leyline_agent.chat.openai import chat_request_view
from leyline_agent.chat_turn import ChatTurn
from leyline_agent.markers import TOOLS, breakpoint_error, marked_end
from leyline_agent.policies import Policy
from leyline_agent.proxy.chat import ChatView, serve_turn
from leyline_agent.proxy.relay import chunks
from leyline_agent.proxy.responses import backend_message

if TYPE_CHECKING:
    from leyline_agent.proxy.app import LeylineProxy

CLAUDE_CODE_SESSION = "X-Claude-Code-Session-Id"


def anthropic_error(
    status: int, message: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        error_body(error_kind(status), message), status_code=status, headers=dict(headers or {})
    )


def _cached_prefix(turn: ChatTurn) -> int:
    """The prompt tokens up to the turn's last ``cache_control`` breakpoint (0: none)."""
    if turn.marker is None:
        return 0
    plan = turn.pending.plan
    if turn.marker.message == TOOLS:  # NOTE: tools render in or before the first message
        return plan.spans[0][1] if plan.spans else 0
    return marked_end(plan.spans, plan.sources, turn.marker.message)


def _sse(kind: str, data: Mapping[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n"


class AnthropicView(ChatView):
    """The Messages format of one request's answer (module docstring)."""

    route = "/v1/messages"
    fit_budget = True  # Claude Code asks max_tokens 128,000 whatever the context

    def __init__(
        self,
        model: str,
        policy: Policy | None = None,
        count_tokens: Callable[[str], int] | None = None,
    ) -> None:
        self.model, self.policy, self.count_tokens = model, policy, count_tokens

    def context_management(self, turn: ChatTurn) -> dict[str, Any] | None:
        """The turn's ``applied_edits`` when the request asked for context editing."""
        if self.count_tokens is None:
            return None
        edits = applied_edits(turn.messages, turn.pending.plan.edits, self.count_tokens)
        return {"applied_edits": edits}

    def error(self, status: int, message: str, kind: str, headers: Mapping[str, str]) -> Response:
        return anthropic_error(status, message, headers)

    def refused(self, message: str, headers: Mapping[str, str]) -> Response:
        return anthropic_error(400, message, headers)

    def backend_failed(self, r: httpx.Response, headers: Mapping[str, str]) -> Response:
        return anthropic_error(r.status_code, f"backend: {backend_message(r)}", headers)

    def answer(self, data: dict[str, Any], turn: ChatTurn, headers: Mapping[str, str]) -> Response:
        choice = (data.get("choices") or [{}])[0]
        usage = anthropic_usage(data.get("usage"), _cached_prefix(turn))
        blocks = content_blocks(choice.get("message") or {})
        answer = message_object(self.model, blocks, choice.get("finish_reason"), usage)
        managed = self.context_management(turn)
        if managed is not None:
            answer["context_management"] = managed
        return JSONResponse(answer, headers=dict(headers))

    def stream(
        self, lines: AsyncIterator[str], turn: ChatTurn, headers: Mapping[str, str]
    ) -> Response:
        return StreamingResponse(
            self.events(lines, turn), media_type="text/event-stream", headers=dict(headers)
        )

    async def events(self, lines: AsyncIterator[str], turn: ChatTurn) -> AsyncIterator[str]:
        """The relayed chat chunks as Anthropic's stream events."""
        zero = anthropic_usage(None)
        start = message_object(self.model, [], None, zero, new_id("msg"))
        start["stop_reason"] = None
        yield _sse("message_start", {"message": start})
        index = -1  # the open content block
        text_open = False
        calls: dict[int, int] = {}  # chat tool-call index -> block index
        usage: dict[str, Any] | None = None
        finish: str | None = None
        async for chunk in chunks(lines):
            if chunk.get("usage") and not chunk.get("choices"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                finish = choice.get("finish_reason") or finish
                if delta.get("content"):
                    if not text_open:
                        if index >= 0:
                            yield _sse("content_block_stop", {"index": index})
                        index, text_open = index + 1, True
                        block = {"type": "text", "text": ""}
                        yield _sse("content_block_start", {"index": index, "content_block": block})
                    text = {"type": "text_delta", "text": delta["content"]}
                    yield _sse("content_block_delta", {"index": index, "delta": text})
                for call in delta.get("tool_calls") or []:
                    fn = call.get("function") or {}
                    k = call.get("index", 0)
                    if k not in calls:
                        if index >= 0:
                            yield _sse("content_block_stop", {"index": index})
                        index, text_open = index + 1, False
                        calls[k] = index
                        use: dict[str, Any] = {"type": "tool_use", "input": {},
                                               "id": call.get("id") or new_id("toolu"),
                                               "name": fn.get("name") or ""}  # fmt: skip
                        yield _sse("content_block_start", {"index": index, "content_block": use})
                    if fn.get("arguments"):
                        part = {"type": "input_json_delta", "partial_json": fn["arguments"]}
                        yield _sse("content_block_delta", {"index": calls[k], "delta": part})
        if index >= 0:
            yield _sse("content_block_stop", {"index": index})
        if usage is None:  # the backend's stream ended early
            yield _sse("error", {"error": error_body("api_error", "the backend's stream ended early")["error"]})  # fmt: skip
            return
        stop = message_object(self.model, [], finish, zero)["stop_reason"]
        if calls:
            stop = "tool_use"
        final = anthropic_usage(usage, _cached_prefix(turn))
        closing: dict[str, Any] = {"delta": {"stop_reason": stop, "stop_sequence": None},
                                   "usage": final}  # fmt: skip
        managed = self.context_management(turn)
        if managed is not None:
            closing["context_management"] = managed
        yield _sse("message_delta", closing)
        yield _sse("message_stop", {})


async def _body(request: Request) -> dict[str, Any] | Response:
    try:
        body = await request.json()
    except ValueError:
        return anthropic_error(400, "the request body is not JSON")
    if not isinstance(body, dict):
        return anthropic_error(400, "the request body must be a JSON object")
    return body


async def create_message(proxy: LeylineProxy, request: Request) -> Response:
    """``POST /v1/messages`` (module docstring)."""
    body = await _body(request)
    if isinstance(body, Response):
        return body
    try:
        chat = chat_body(body)
        policy = context_policy(body.get("context_management"))
    except MessagesError as e:
        return anthropic_error(400, str(e))
    system = body.get("system")  # NOTE: count the blocks as sent (chat_body merges them)
    too_many = breakpoint_error(
        [*([{"content": system}] if isinstance(system, list) else []), *body["messages"]],
        body.get("tools"),
    )
    if too_many is not None:
        return anthropic_error(400, too_many)
    count = (lambda t: len(proxy.renderer.encode(t))) if "context_management" in body else None
    claude_session = request.headers.get(CLAUDE_CODE_SESSION)
    if claude_session and not chat.get("prompt_cache_key"):
        chat["prompt_cache_key"] = f"claude-code:{claude_session}"
    return await serve_turn(proxy, request, chat, AnthropicView(chat["model"], policy, count))


async def count_tokens(proxy: LeylineProxy, request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": n}``, the prompt as the backend's
    chat template renders it (no session, nothing sent to the backend)."""
    body = await _body(request)
    if isinstance(body, Response):
        return body
    try:
        chat = chat_body({**body, "max_tokens": body.get("max_tokens") or 1})
        messages, tools = chat_request_view(chat["messages"], chat.get("tools"))
        rendered = proxy.renderer.render(messages, tools)
    except MessagesError as e:
        return anthropic_error(400, str(e))
    except jinja2.TemplateError as e:
        return anthropic_error(400, f"the chat template refused the messages: {e}")
    return JSONResponse({"input_tokens": len(rendered.tokens)})


def add_routes(app: FastAPI, proxy: LeylineProxy) -> None:
    """The Messages routes on the proxy's app (before its catch-all forward)."""

    async def create(request: Request) -> Response:
        return await create_message(proxy, request)

    async def count(request: Request) -> Response:
        return await count_tokens(proxy, request)

    app.add_api_route("/v1/messages", create, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", count, methods=["POST"])
