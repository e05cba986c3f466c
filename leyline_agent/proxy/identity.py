"""Who a proxy session is: ``SessionKey(tenant, kind, name, conversation)`` and its escaped names,
the keys a request names its session by (``session_keys``), and the form in which messages are
compared when a request is matched to a session by its history (see ``sessions.py`` for the
resolution order).

The mapping is injective: every component is percent-escaped (``urllib.parse.quote`` with no safe
characters, so the escaped text has no ``:``) before it is joined, so two different keys never
share a namespace, a public id or a record file. The namespace on the backend is
``leyline:<tenant>:<kind>:<name>`` (escaped; spelled in ``placement.py``) together with the client's ``cache_salt``; until its
first splice a session's requests use the tenant's shared namespace ``leyline:<tenant>:shared``
instead (exact KV is shared within a tenant and salt, amortized KV never; ``placement.py``). The public id (the
``X-Leyline-Session`` answer header, ``/leyline/sessions/{id}``) is the escaped name for a header
session (a plain name such as ``dg-1a2b-splice-config`` is unchanged) and ``user:<escaped>`` or
``<kind>:<escaped>`` otherwise (``cache_key:<escaped prompt_cache_key>``, ``anon:<hex>``), so a
header ``cache_key:k`` (public id ``cache_key%3Ak``) is not the ``prompt_cache_key`` ``k``. The
``user`` field names an end user, not a conversation: each of a user's conversations is the key
``(tenant, "user", <user>, <hex>)``, public id ``user:<escaped user>:<hex>`` and namespace
``leyline:<tenant>:user:<user>:<hex>`` (five parts). The same name in another tenant is another
session.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

from leyline_agent.placement import escape, namespace, shared_namespace

SESSION_HEADER = "X-Leyline-Session"
# NOTE: openai-python and openai-node send the number of earlier attempts of a request
RETRY_HEADER = "x-stainless-retry-count"
FORK_HEADER = "X-Leyline-Fork-From"  # a new session's first request: start from this session
Kind = Literal["header", "cache_key", "user", "anon"]


def public_ids(ref: str) -> list[str]:
    """The public ids a client's reference to a session may mean, in the order tried: ``ref``
    itself (an id as listed by ``/leyline/sessions``), then the id of the header session named
    ``ref`` (the name as sent in ``X-Leyline-Session``: ``a:b`` -> ``a%3Ab``)."""
    return list(dict.fromkeys([ref, escape(ref)]))


class SessionKey(NamedTuple):
    """Who a session belongs to and what it is called (see the module docstring)."""

    tenant: str
    kind: Kind
    name: str
    conversation: str = ""  # kind ``user``: which of the user's conversations (a random hex)

    @property
    def public_id(self) -> str:
        name = escape(self.name)
        if self.conversation:
            name = f"{name}:{escape(self.conversation)}"
        return name if self.kind == "header" else f"{self.kind}:{name}"

    @property
    def namespace(self) -> str:
        """The backend's ``extra_key`` of the session (its own, private one)."""
        parts = [escape(self.name)] + ([escape(self.conversation)] if self.conversation else [])
        return namespace(escape(self.tenant), self.kind, *parts)

    @property
    def shared_namespace(self) -> str:
        """The tenant's namespace of exact KV, which the session uses until its first splice
        (``SessionCore``); three parts, so no session's own namespace (four or five) is it."""
        return shared_namespace(self.tenant)


class SessionKeys(NamedTuple):
    """What a request names its session by, each None when absent (``sessions.py``: the header,
    then ``prompt_cache_key``, then the ``user`` scope, then the history)."""

    header: str | None = None  # X-Leyline-Session
    cache_key: str | None = None  # the body's prompt_cache_key (Chat Completions, Responses)
    user: str | None = None  # the body's user: an end user, a scope of conversations
    retry: bool = False  # the client says it sends this request again (RETRY_HEADER >= 1)


def session_keys(body: Mapping[str, Any], headers: Mapping[str, str]) -> SessionKeys:
    """The session keys of a request: its ``X-Leyline-Session`` header (``headers`` as the
    request's, case-insensitive), and the body's ``prompt_cache_key`` and ``user``; a value that
    is not a non-empty string counts as absent (SGLang ignores both fields). ``retry``: the
    OpenAI clients' ``x-stainless-retry-count`` header is 1 or more (a retry after a timeout or a
    5xx)."""

    def text(value: Any) -> str | None:
        return value if isinstance(value, str) and value else None

    retries = (headers.get(RETRY_HEADER) or "").strip()
    return SessionKeys(
        text(headers.get(SESSION_HEADER)),
        text(body.get("prompt_cache_key")),
        text(body.get("user")),
        retries.isdigit() and int(retries) >= 1,
    )


def match_form(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as session matching compares it: without ``cache_control`` markers (on the
    message or its content parts), a content made only of text parts joined into one string,
    ``None`` content as ``""``. An agent that moves its cache marker to the newest message each
    turn (SWE-agent, Anthropic-style prompts) still extends its own history."""
    out = {k: v for k, v in message.items() if k != "cache_control"}
    content = out.get("content")
    if isinstance(content, list):
        parts = [
            {k: v for k, v in p.items() if k != "cache_control"} if isinstance(p, Mapping) else p
            for p in content
        ]
        texts = [
            p.get("text")
            for p in parts
            if isinstance(p, Mapping) and p.get("type") == "text" and len(p) == 2
        ]
        if len(texts) == len(parts) and all(isinstance(t, str) for t in texts):
            out["content"] = "".join(texts)  # type: ignore[arg-type]
        else:
            out["content"] = parts
    elif content is None and "content" in out:
        out["content"] = ""
    return out


def size(message: Mapping[str, Any]) -> int:
    return len(json.dumps(message, sort_keys=True, ensure_ascii=False, default=str))


def shared(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> int:
    """Leading messages ``a`` and ``b`` have in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
