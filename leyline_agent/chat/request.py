"""What SGLang's chat endpoint does with a request before and around the chat template.

Mirrors sglang 0.5.23 ``serving_chat`` (``_validate_request``, ``_apply_jinja_template``,
``_handle_last_assistant_message``, ``_convert_to_internal_request``) and the tokenizer manager's
length checks, without importing SGLang:

- ``request_error``: the message shapes the backend certainly refuses (400), so that the proxy can
  refuse them before any splice, and text that is not Unicode (``text_error``: a lone surrogate,
  which the backend's JSON parser refuses and no tokenizer can encode);
- ``length_error``: a prompt (plus the completion budget) past the context length;
- ``final_assistant``: a list that ends with an assistant message is rendered with that message
  as a *user* turn, or, with ``continue_final_message``, without it and with its text appended to
  the prompt after the generation prompt;
- ``template_kwargs``: the extra template variables (``chat_template_kwargs``, with
  ``reasoning_effort`` from either place).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from leyline_agent.messages import content_text, is_text_parts

ROLES = ("system", "developer", "user", "assistant", "tool", "function", "latest_reminder", "root")
# The roles an error names: OpenAI's (SGLang also takes ``latest_reminder`` and ``root``, roles of
# some models' templates, and the legacy ``function``; they are accepted, not advertised).
OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool")
_FINAL_TEXT_TYPES = ("text", "input_text")  # what makes a final assistant message text


def _message_error(k: int, m: Any) -> str | None:
    if not isinstance(m, Mapping):
        return f"messages[{k}] must be an object"
    role = m.get("role")
    if not isinstance(role, str) or role.lower() not in ROLES:
        return f"messages[{k}]: 'role' must be one of {', '.join(map(repr, OPENAI_ROLES))}"
    call_id = m.get("tool_call_id")
    if role.lower() == "tool" and (not isinstance(call_id, str) or not call_id):
        return (
            f"messages[{k}]: a tool message needs 'tool_call_id', the id of the assistant's tool "
            "call it answers"
        )
    content = m.get("content")
    if role.lower() == "user" and content is None:
        return f"messages[{k}]: a user message needs 'content'"
    if content is not None and not isinstance(content, (str, list)):
        return f"messages[{k}]: 'content' must be a string, a list of parts or null"
    if isinstance(content, list) and not all(
        isinstance(p, Mapping) and isinstance(p.get("type"), str) for p in content
    ):
        return f"messages[{k}]: every content part must be an object with a 'type'"
    calls = m.get("tool_calls")
    if calls is None:
        return None
    if not isinstance(calls, list):
        return f"messages[{k}]: 'tool_calls' must be a list"
    for call in calls:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping):
            return f"messages[{k}]: every tool call needs a 'function' object"
        args = fn.get("arguments")
        if role.lower() == "assistant" and isinstance(args, str):
            error = _arguments_error(args)
            if error is not None:
                return error
    return None


@lru_cache(maxsize=4096)
def _arguments_error(args: str) -> str | None:
    """Why assistant tool-call ``arguments`` are refused (remembered: a request repeats every
    earlier turn's calls)."""
    try:
        parsed = json.loads(args)
    except ValueError:
        return "Assistant tool call function.arguments must be valid JSON."
    if not isinstance(parsed, dict):
        return "Assistant tool call function.arguments must be a JSON object."
    return None


def _unicode_error(value: Any, where: str) -> str | None:
    """The path of the first string (key or value) in ``value`` that is not valid Unicode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"{where} (character {e.start}: {value[e.start]!r})"
        return None
    if isinstance(value, Mapping):
        for k, v in value.items():
            error = _unicode_error(k, f"{where} (a key)") or _unicode_error(v, f"{where}.{k}")
            if error is not None:
                return error
    elif isinstance(value, list):
        for i, v in enumerate(value):
            error = _unicode_error(v, f"{where}[{i}]")
            if error is not None:
                return error
    return None


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def may_hold_surrogates(raw: bytes) -> bool:
    """Whether the JSON document ``raw`` may decode to a string with a surrogate (False: none).

    Only a ``\\uD800``-``\\uDFFF`` escape writes one: UTF-8 cannot encode a surrogate, and a
    decoder refuses such bytes. One scan in C; a pair (an escaped emoji) or an escaped backslash
    before ``uD8`` also answers True, and ``text_error`` then tells.
    """
    return _SURROGATE_ESCAPE.search(raw) is not None


def text_error(body: Mapping[str, Any], known: int = 0) -> str | None:
    """Why a request body's text is refused (None: every string in it is valid Unicode).

    A lone surrogate (``"\\udcff"``: what JSON encoders write for bytes decoded with
    ``errors="surrogateescape"``, e.g. a tool's binary output) cannot be encoded as UTF-8: the
    backend's JSON parser refuses the body (400) and no tokenizer can encode it. Checked in every
    string of the body: contents and content parts, names, tool-call arguments, tool schemas;
    ``known``: the first messages are known to pass (``seen.SeenMessages``), not checked again.
    """
    rest = body
    if known and isinstance(body.get("messages"), list):
        rest = {**body, "messages": body["messages"][known:]}
    try:  # NOTE: one pass in C (a surrogate in any key or value fails the encode); the path to
        # it is looked for only then
        json.dumps(rest, ensure_ascii=False).encode("utf-8")
        return None
    except (UnicodeEncodeError, TypeError, ValueError):
        pass
    for k, v in body.items():
        where = _unicode_error(v, str(k))
        if where is None and isinstance(k, str):
            where = _unicode_error(k, "the body (a key)")
        if where is not None:
            return (
                f"the request holds text that is not valid Unicode (a lone surrogate) at "
                f"{where}: send text as UTF-8; decode bytes with errors='replace', not "
                "'surrogateescape'"
            )
    return None


def request_error(body: Any, known: int = 0, text: bool = True) -> str | None:
    """Why the backend would refuse this chat-completions body with a 400 (None: it may not).

    Checks only what SGLang 0.5.23 refuses for every model: the body shape, each message's role,
    content and tool calls (assistant tool-call ``arguments`` must be a JSON object), ``n``, and
    text that is not valid Unicode anywhere in the body (``text_error``); and, as OpenAI's API
    does (SGLang accepts it), a ``tool`` message without a ``tool_call_id``: which call it
    answers cannot be told. Template errors (a role the template does not render) come from
    rendering.

    ``known``: the first messages are known to pass (``seen.SeenMessages``: a session's last
    request held them), not checked again. ``text=False``: the shape only, not the Unicode.
    """
    if not isinstance(body, Mapping):
        return "the request body must be a JSON object"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list"
    for k in range(known, len(messages)):
        error = _message_error(k, messages[k])
        if error is not None:
            return error
    n = body.get("n", 1)
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        return "'n' must be an integer >= 1"
    return text_error(body, known) if text else None


def max_new_tokens(body: Mapping[str, Any]) -> int | None:
    """The completion budget: ``max_completion_tokens``, else ``max_tokens`` (SGLang's order)."""
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def length_error(prompt_tokens: int, max_new: int | None, context_len: int | None) -> str | None:
    """The tokenizer manager's refusal of a prompt that does not fit (None: it fits)."""
    if not context_len:
        return None
    if prompt_tokens >= context_len:
        return (
            f"The input ({prompt_tokens} tokens) is longer than the model's context length "
            f"({context_len} tokens)."
        )
    if max_new is not None and prompt_tokens + max_new > context_len:
        return (
            "Requested token count exceeds the model's maximum context length of "
            f"{context_len} tokens. You requested a total of {prompt_tokens + max_new} tokens: "
            f"{prompt_tokens} tokens from the input messages and {max_new} tokens for the "
            "completion. Please reduce the number of tokens in the input messages or the "
            "completion to fit within the limit."
        )
    return None


def final_assistant(
    messages: Sequence[Mapping[str, Any]], continue_final_message: bool = False
) -> tuple[list[dict[str, Any]], str | None]:
    """``(messages to render, text appended after the generation prompt)``.

    SGLang renders a list ending with an assistant message whose content is text (``None`` and
    text parts count: they become a string first) with that message replaced by
    ``{"role": "user", "content": text}`` (its tool calls dropped), or, under
    ``continue_final_message``, without it and with ``encode(text)`` appended to the prompt.
    """
    out = [dict(m) for m in messages]
    if not out or out[-1].get("role") != "assistant":
        return out, None
    content = out[-1].get("content")
    if content is None or is_text_parts(content, _FINAL_TEXT_TYPES):
        content = content_text(content, _FINAL_TEXT_TYPES)
    if not isinstance(content, str):
        return out, None
    if continue_final_message:
        return out[:-1], content
    out[-1] = {"role": "user", "content": content}
    return out, None


def template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """The extra chat-template variables SGLang passes for this request.

    ``chat_template_kwargs`` as given, with ``reasoning_effort`` set from it or, failing that,
    from the top-level field (SGLang moves the kwargs' one to the request first).
    """
    kwargs = dict(body.get("chat_template_kwargs") or {})
    effort = kwargs.pop("reasoning_effort", None)
    if effort is None:
        effort = body.get("reasoning_effort")
    if effort is not None:
        kwargs["reasoning_effort"] = effort
    return kwargs
