"""Who a proxy session is: ``SessionKey(tenant, kind, name)`` and its escaped names, and the form
in which messages are compared when an anonymous request is matched to a session (see
``sessions.py`` for the resolution order).

The mapping is injective: every component is percent-escaped (``urllib.parse.quote`` with no safe
characters, so the escaped text has no ``:``) before it is joined, so two different keys never
share a namespace, a public id or a record file. The namespace on the backend is
``leyline:<tenant>:<kind>:<name>`` (escaped; spelled in ``placement.py``) together with the client's ``cache_salt``; until its
first splice a session's requests use the tenant's shared namespace ``leyline:<tenant>:shared``
instead (exact KV is shared within a tenant and salt, amortized KV never; ``placement.py``). The public id (the
``X-Leyline-Session`` answer header, ``/leyline/sessions/{id}``) is the escaped name for a header
session (a plain name such as ``dg-1a2b-splice-config`` is unchanged) and ``user:<escaped>`` or
``anon:<hex>`` otherwise, so a header ``user:u1`` (public id ``user%3Au1``) is not the ``user``
field ``u1`` (``user:u1``). The same name in another tenant is another session.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

from leyline_agent.placement import escape, namespace, shared_namespace

SESSION_HEADER = "X-Leyline-Session"
FORK_HEADER = "X-Leyline-Fork-From"  # a new session's first request: start from this session
Kind = Literal["header", "user", "anon"]


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

    @property
    def public_id(self) -> str:
        name = escape(self.name)
        return name if self.kind == "header" else f"{self.kind}:{name}"

    @property
    def namespace(self) -> str:
        """The backend's ``extra_key`` of the session (its own, private one)."""
        return namespace(escape(self.tenant), self.kind, escape(self.name))

    @property
    def shared_namespace(self) -> str:
        """The tenant's namespace of exact KV, which the session uses until its first splice
        (``SessionCore``); three parts, so no session's own namespace (four) is it."""
        return shared_namespace(self.tenant)


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
