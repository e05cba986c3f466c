"""The client's side of a chat-completions exchange: the request as the server's template will see
it, and what to read back from the response (prompt token ids, usage).

``chat_request_view`` is the request view the proxy and ``LeylineSession`` plan on and send;
``chat.sglang`` is the view SGLang hands its chat template. The first is a fixed point of the
second's normalisation, so both sides render the same tokens.

``role: "developer"`` (OpenAI's name for system instructions since its o-series): SGLang 0.5.23
hands it to the chat template unchanged (``serving_chat._apply_jinja_template``; only its Kimi K3
and Harmony paths rename it), and most templates refuse it (``raise_exception``) or drop it. Where
the template does not render it (``renders_developer``) the view sends it as ``system``: the body
forwarded and the prompt rendered both carry the template's system role.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from leyline_agent.chat.request import final_assistant
from leyline_agent.chat.sglang import sglang_tools
from leyline_agent.markers import strip_markers
from leyline_agent.messages import served_content, tool_call_arguments

if TYPE_CHECKING:
    from leyline_agent.chat.render import Renderer

_PROBE = "\ue000developer"  # private-use text no real instruction holds
_RENDERS_DEVELOPER: weakref.WeakKeyDictionary[Renderer, bool] = weakref.WeakKeyDictionary()


def renders_developer(renderer: Renderer) -> bool:
    """Whether ``renderer``'s chat template renders a ``developer`` message (its text is in the
    prompt); False when the template refuses the role or drops it. Probed once per renderer."""
    known = _RENDERS_DEVELOPER.get(renderer)
    if known is None:
        probe = [{"role": "developer", "content": _PROBE}, {"role": "user", "content": "hi"}]
        try:
            known = _PROBE in renderer.render_text(probe)
        except Exception:  # NOTE: whatever the template raises, it does not serve the role
            known = False
        _RENDERS_DEVELOPER[renderer] = known
    return known


def served_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """``message`` with ``content: None`` as ``""``, every tool call's JSON-object
    ``arguments`` re-serialised as the template's ``tojson`` writes them, and no
    ``cache_control`` marker (read as a pin by ``markers.cache_marker``, never templated)."""
    out = strip_markers(message)
    out["content"] = served_content(out)
    if isinstance(out.get("tool_calls"), list):
        calls = []
        for call in out["tool_calls"]:
            fn = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
                call = {**call, "function": {**fn, "arguments": tool_call_arguments(call, False)}}
            calls.append(call)
        out["tool_calls"] = calls
    return out


def chat_request_view(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: Any = None,
    continue_final_message: bool = False,
    developer_as_system: bool = False,
    served: Sequence[dict[str, Any]] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools of a chat request as SGLang's chat template will see them.

    SGLang (0.5.x) passes every tool through its pydantic ``Tool`` model before templating (which
    adds ``"defer_loading": null``, ``description``/``parameters`` when absent, and drops unknown
    keys), parses tool-call ``arguments`` strings into objects that the template re-serialises
    with ``tojson``, renders no tools under ``tool_choice="none"`` and only the named one under a
    named ``tool_choice``, and renders a final assistant message with text content as a user
    turn (unless ``continue_final_message``: ``chat_turn.prepare`` then plans without it).
    Planning on the raw request would give other tokens than the server's prompt (every splice
    would then miss). This view is a fixed point of that normalisation: send it and render it,
    and both sides agree. Semantics are unchanged. ``developer_as_system``: a ``developer``
    message is sent as ``system`` (for a template that does not render the role, see
    ``renders_developer``). ``served``: each message's ``served_message``, when known (a
    session's ``seen.SeenMessages``).
    """
    if tools and tool_choice == "none":
        tools = None
    elif tools and isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name")
        tools = [t for t in tools if (t.get("function") or {}).get("name") == name] or None
    out = list(served) if served is not None else [served_message(m) for m in messages]
    if developer_as_system:
        out = [
            {**m, "role": "system"} if str(m.get("role")).lower() == "developer" else m for m in out
        ]
    if not continue_final_message:
        out = final_assistant(out)[0]
    return out, sglang_tools(tools)


def pop_prompt_ids(data: dict[str, Any], keep: bool = False) -> list[int] | None:
    """The prompt token ids of a non-streamed chat completion asked with
    ``return_prompt_token_ids`` (SGLang 0.5.23 puts them in every choice, as
    ``choices[i].prompt_token_ids``), removed from ``data`` unless ``keep``."""
    ids: list[int] | None = None
    for choice in data.get("choices") or []:
        if isinstance(choice, dict) and isinstance(choice.get("prompt_token_ids"), list):
            ids = ids if ids is not None else list(choice["prompt_token_ids"])
            if not keep:
                del choice["prompt_token_ids"]
    return ids


def read_usage(data: dict[str, Any], default_prompt: int) -> tuple[int, int]:
    """``(prompt_tokens, cached_tokens)`` of a chat completion (or its streamed usage chunk).

    Fills ``usage.prompt_tokens_details.cached_tokens`` in place (0 when the backend did not
    report it, e.g. SGLang without ``--enable-cache-report``); ``default_prompt`` stands in for a
    missing ``usage.prompt_tokens``.
    """
    usage = data.get("usage") or {}
    prompt = int(usage.get("prompt_tokens", default_prompt))
    details = usage.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or 0)
    usage["prompt_tokens_details"] = {**details, "cached_tokens": cached}
    data["usage"] = usage
    return prompt, cached
