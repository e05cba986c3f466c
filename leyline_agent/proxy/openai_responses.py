"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``: OpenAI's Responses API
through the proxy, a thin adapter over the chat turn (request view → turn core → response view).

- The request becomes a chat-completions body (``chat.responses.chat_body``) and runs through
  ``chat.serve_turn``: the same session resolution, checks before any splice, policy, diff,
  splice and accounting as ``/v1/chat/completions``. ``ResponsesView`` answers in the Responses
  format: a ``Response`` object, errors as ``{"error": {...}}``, and streams as Responses events
  (``response.created``, ``response.output_item.added``, ``response.output_text.delta``,
  ``response.function_call_arguments.delta``, ... ``response.completed`` with the usage:
  ``input_tokens``, ``input_tokens_details.cached_tokens``, ``output_tokens``).
- **Stored responses** (``store`` is true by default): the proxy keeps each one's conversation
  (``ResponseStore``: per tenant, at most ``max_entries``, each for ``ttl_s`` seconds), so a
  request with ``previous_response_id`` continues it; a chain is one conversation, hence one
  session (its history extends the session's). An unknown, deleted or expired id is a 404.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from leyline_agent.chat.responses import (
    Message,
    ResponsesError,
    answer_message,
    chat_body,
    new_id,
    output_items,
    response_object,
)
from leyline_agent.chat_turn import ChatTurn
from leyline_agent.proxy.auth import tenant_of
from leyline_agent.proxy.chat import ChatView, serve_turn
from leyline_agent.proxy.relay import chunks
from leyline_agent.proxy.response_store import ResponseStore
from leyline_agent.proxy.responses import backend_message

if TYPE_CHECKING:
    from leyline_agent.proxy.app import LeylineProxy


def openai_error(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """An error in the OpenAI API's format."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


def _sse(kind: str, seq: int, **fields: Any) -> str:
    data = json.dumps({"type": kind, "sequence_number": seq, **fields}, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n"


class ResponsesView(ChatView):
    """The Responses format of one request's answer (module docstring)."""

    route = "/v1/responses"

    def __init__(
        self,
        store: ResponseStore,
        tenant: str,
        body: Mapping[str, Any],
        conversation: list[Message],
    ) -> None:
        self.store, self.tenant, self.body, self.conversation = store, tenant, body, conversation
        self.response_id = new_id("resp")

    def error(self, status: int, message: str, kind: str, headers: Mapping[str, str]) -> Response:
        return openai_error(status, message, kind, headers=headers)

    def refused(self, message: str, headers: Mapping[str, str]) -> Response:
        return openai_error(400, message, headers=headers)

    def backend_failed(self, r: httpx.Response, headers: Mapping[str, str]) -> Response:
        message = backend_message(r)
        kind = "invalid_request_error" if r.status_code < 500 else "server_error"
        return openai_error(r.status_code, f"backend: {message}", kind, headers=headers)

    def keep(self, response: dict[str, Any], items: list[dict[str, Any]]) -> None:
        if self.body.get("store", True) is not False and response["status"] != "failed":
            self.store.put(self.tenant, response, [*self.conversation, answer_message(items)])

    def answer(self, data: dict[str, Any], turn: ChatTurn, headers: Mapping[str, str]) -> Response:
        choice = (data.get("choices") or [{}])[0]
        items = output_items(choice.get("message") or {})
        response = response_object(
            self.body, self.response_id, items, data.get("usage"),
            finish_reason=choice.get("finish_reason"),
        )  # fmt: skip
        self.keep(response, items)
        return JSONResponse(response, headers=dict(headers))

    def stream(
        self, lines: AsyncIterator[str], turn: ChatTurn, headers: Mapping[str, str]
    ) -> Response:
        return StreamingResponse(
            self.events(lines), media_type="text/event-stream", headers=dict(headers)
        )

    async def events(self, lines: AsyncIterator[str]) -> AsyncIterator[str]:
        """The relayed chat chunks as Responses events; the response is stored at the end."""
        seq = 0

        def ev(kind: str, **fields: Any) -> str:
            nonlocal seq
            seq += 1
            return _sse(kind, seq - 1, **fields)

        rid, body = self.response_id, self.body
        started = response_object(body, rid, [], None, status="in_progress")
        yield ev("response.created", response=started)
        yield ev("response.in_progress", response=started)
        output: list[dict[str, Any]] = []
        message: dict[str, Any] | None = None
        calls: dict[int, dict[str, Any]] = {}
        usage: dict[str, Any] | None = None
        finish: str | None = None
        async for chunk in chunks(lines):
            if chunk.get("usage") and not chunk.get("choices"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                finish = choice.get("finish_reason") or finish
                if delta.get("content"):
                    if message is None:
                        message = {"type": "message", "id": new_id("msg"), "role": "assistant",
                                   "status": "in_progress", "content": []}  # fmt: skip
                        output.append(message)
                        at = len(output) - 1
                        yield ev("response.output_item.added", output_index=at, item=message)
                        part = {"type": "output_text", "text": "", "annotations": []}
                        message["content"].append(part)
                        yield ev("response.content_part.added", item_id=message["id"],
                                 output_index=at, content_index=0, part=part)  # fmt: skip
                    part = message["content"][0]
                    part["text"] += delta["content"]
                    yield ev("response.output_text.delta", item_id=message["id"],
                             output_index=output.index(message), content_index=0,
                             delta=delta["content"], logprobs=[])  # fmt: skip
                for call in delta.get("tool_calls") or []:
                    fn = call.get("function") or {}
                    item = calls.get(call.get("index", 0))
                    if item is None:
                        item = {"type": "function_call", "id": new_id("fc"),
                                "call_id": call.get("id") or new_id("call"),
                                "name": fn.get("name") or "", "arguments": "",
                                "status": "in_progress"}  # fmt: skip
                        calls[call.get("index", 0)] = item
                        output.append(item)
                        yield ev("response.output_item.added", output_index=len(output) - 1,
                                 item=item)  # fmt: skip
                    if fn.get("arguments"):
                        item["arguments"] += fn["arguments"]
                        yield ev("response.function_call_arguments.delta", item_id=item["id"],
                                 output_index=output.index(item), delta=fn["arguments"])  # fmt: skip
        for at, item in enumerate(output):
            item["status"] = "completed"
            if item["type"] == "message":
                part = {**item["content"][0], "logprobs": []}
                yield ev("response.output_text.done", item_id=item["id"], output_index=at,
                         content_index=0, text=part["text"], logprobs=[])  # fmt: skip
                yield ev("response.content_part.done", item_id=item["id"], output_index=at,
                         content_index=0, part=item["content"][0])  # fmt: skip
            else:
                yield ev("response.function_call_arguments.done", item_id=item["id"],
                         output_index=at, name=item["name"], arguments=item["arguments"])  # fmt: skip
            yield ev("response.output_item.done", output_index=at, item=item)
        if usage is None:  # the backend's stream ended early
            failed = response_object(body, rid, output, None, status="failed")
            failed["error"] = {
                "code": "server_error",
                "message": "the backend's stream ended early",
            }
            yield ev("response.failed", response=failed)
            return
        done = response_object(body, rid, output, usage, finish_reason=finish)
        self.keep(done, output)
        yield ev("response.completed", response=done)


async def create_response(proxy: LeylineProxy, request: Request) -> Response:
    """``POST /v1/responses`` (module docstring)."""
    try:
        body = await request.json()
    except ValueError:
        return openai_error(400, "the request body is not JSON")
    if not isinstance(body, dict):
        return openai_error(400, "the request body must be a JSON object")
    tenant, store = tenant_of(request), proxy.responses
    history: list[Message] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        stored = store.get(tenant, previous) if isinstance(previous, str) else None
        if stored is None:
            return openai_error(
                404,
                f"Previous response with id {previous!r} not found: unknown, deleted or expired "
                f"(the proxy keeps stored responses {store.ttl_s:g} s, at most "
                f"{store.max_entries})",
                param="previous_response_id",
            )
        history = stored.conversation
    try:
        chat, conversation = chat_body(body, history)
    except ResponsesError as e:
        return openai_error(400, str(e), param=e.param)
    return await serve_turn(proxy, request, chat, ResponsesView(store, tenant, body, conversation))


def retrieve_response(proxy: LeylineProxy, request: Request, response_id: str) -> Response:
    """``GET /v1/responses/{id}``: a stored response of the caller's tenant."""
    stored = proxy.responses.get(tenant_of(request), response_id)
    if stored is None:
        return openai_error(404, f"Response with id {response_id!r} not found", param="response_id")
    return JSONResponse(stored.response)


def delete_response(proxy: LeylineProxy, request: Request, response_id: str) -> Response:
    """``DELETE /v1/responses/{id}``."""
    if not proxy.responses.delete(tenant_of(request), response_id):
        return openai_error(404, f"Response with id {response_id!r} not found", param="response_id")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def add_routes(app: FastAPI, proxy: LeylineProxy) -> None:
    """The Responses routes on the proxy's app (before its catch-all forward)."""

    async def create(request: Request) -> Response:
        return await create_response(proxy, request)

    def retrieve(request: Request, response_id: str) -> Response:
        return retrieve_response(proxy, request, response_id)

    def delete(request: Request, response_id: str) -> Response:
        return delete_response(proxy, request, response_id)

    app.add_api_route("/v1/responses", create, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", retrieve, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", delete, methods=["DELETE"])
