"""The proxy's sessions: which conversation a chat-completions request continues.

A session's identity is ``SessionKey(tenant, kind, name)``; the tenant is the caller's (see
``auth.py``; ``default`` without keys). Resolution, in order:

1. the ``X-Leyline-Session`` header: kind ``header``, the name is the header's value;
2. the OpenAI ``user`` field: kind ``user``, the name is its value;
3. the live anonymous session of the same tenant and ``cache_salt`` whose committed message list
   (what its last finished turn received) shares the longest prefix with the incoming one (see
   ``SessionRegistry._match``);
4. otherwise a new anonymous session (kind ``anon``, a random name).

The mapping is injective: every component is percent-escaped (``urllib.parse.quote`` with no safe
characters, so the escaped text has no ``:``) before it is joined, so two different keys never
share a namespace, a public id or a record file. The namespace on the backend is
``leyline:<tenant>:<kind>:<name>`` (escaped) together with the client's ``cache_salt``: one value
``(extra_key, cache_salt)`` for the chat request and the splice alike. The public id (the
``X-Leyline-Session`` answer header, ``/leyline/sessions/{id}``) is the escaped name for a header
session (a plain name such as ``dg-1a2b-splice-config`` is unchanged) and ``user:<escaped>`` or
``anon:<hex>`` otherwise, so a header ``user:u1`` (public id ``user%3Au1``) is not the ``user``
field ``u1`` (``user:u1``). The same name in another tenant is another session.

Named sessions (1, 2) are never matched by prefix, so an anonymous agent cannot continue them.
Every session owns a :class:`SessionCore` and an ``asyncio.Lock``: the turns of one session run
one at a time (``begin`` → request → ``finish``), different sessions concurrently. The
registry's own table is guarded by a ``threading.Lock``. Past ``max_sessions`` the least recently
used idle session is dropped; its counters are kept in ``SessionRegistry.retired`` (and per
tenant) so that totals never go down.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, NamedTuple
from urllib.parse import quote

from leyline_agent.proxy.auth import DEFAULT_TENANT
from leyline_agent.session import SessionCore, TurnRecord

SESSION_HEADER = "X-Leyline-Session"
Source = Literal["header", "user", "prefix", "new"]
Kind = Literal["header", "user", "anon"]
# NOTE: an anonymous request may continue a session whose history it does not extend exactly
# (the agent edited it) when the shared prefix is at least this share of the session's history.
MIN_SHARED = 0.5


def _escape(text: str) -> str:
    """Percent-escape everything but ``A-Za-z0-9_.-~`` (reversible; the result has no ``:``)."""
    return quote(text, safe="")


class SessionKey(NamedTuple):
    """Who a session belongs to and what it is called (see the module docstring)."""

    tenant: str
    kind: Kind
    name: str

    @property
    def public_id(self) -> str:
        name = _escape(self.name)
        return name if self.kind == "header" else f"{self.kind}:{name}"

    @property
    def namespace(self) -> str:
        """The backend's ``extra_key`` of the session."""
        return f"leyline:{_escape(self.tenant)}:{self.kind}:{_escape(self.name)}"


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


def _size(message: Mapping[str, Any]) -> int:
    return len(json.dumps(message, sort_keys=True, ensure_ascii=False, default=str))


@dataclass
class Counters:
    """Sums over turns (tokens are counts; times in milliseconds).

    ``splice_misses``: edited turns whose splice could not run (the request went out anyway).
    """

    turns: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    splice_prefilled_tokens: int = 0
    rotated_tokens: int = 0
    best_cached_tokens: int = 0
    directives_amortize: int = 0
    directives_forget: int = 0
    edited_turns: int = 0
    spliced_turns: int = 0
    splice_misses: int = 0
    splice_ms: float = 0.0
    request_ms: float = 0.0
    misses_by_reason: Counter[str] = field(default_factory=Counter)

    def add(self, r: TurnRecord) -> None:
        self.turns += 1
        self.prompt_tokens += r.prompt_tokens
        self.cached_tokens += r.cached_tokens
        self.prefilled_tokens += r.prefilled_tokens
        self.splice_prefilled_tokens += r.splice_prefilled
        self.rotated_tokens += r.rotated_tokens
        self.best_cached_tokens += r.best_cached_tokens
        self.directives_amortize += r.directives_amortize
        self.directives_forget += r.directives_forget
        self.edited_turns += r.edited
        self.spliced_turns += r.spliced
        self.splice_misses += r.splice_error is not None
        if r.splice_error is not None:
            self.misses_by_reason[r.splice_miss_reason or "backend_error"] += 1
        self.splice_ms += r.splice_ms
        self.request_ms += r.request_ms

    def merge(self, other: Counters) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @classmethod
    def of(cls, records: Sequence[TurnRecord]) -> Counters:
        out = cls()
        for r in records:
            out.add(r)
        return out

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["misses_by_reason"] = dict(self.misses_by_reason)
        return out


@dataclass
class ProxySession:
    """One conversation behind the proxy."""

    key: SessionKey
    core: SessionCore
    source: Source
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    warned: bool = False  # logged that the backend's prompt differs from the rendered one
    # the committed messages last seen by committed_form(), their match forms, cumulative sizes
    _seen: list[dict[str, Any]] | None = field(default=None, repr=False)
    _form: tuple[list[dict[str, Any]], list[int]] = field(
        default_factory=lambda: ([], []), repr=False
    )

    @property
    def id(self) -> str:
        return self.key.public_id

    @property
    def tenant(self) -> str:
        return self.key.tenant

    @property
    def named(self) -> bool:
        return self.key.kind != "anon"

    def committed_form(self) -> tuple[list[dict[str, Any]], list[int]]:
        """The committed messages' match forms and their cumulative sizes (characters of
        canonical JSON, a stand-in for rendered tokens); cached until the next commit."""
        if self._seen is not self.core.messages:
            forms = [match_form(m) for m in self.core.messages]
            sizes, total = [], 0
            for f in forms:
                total += _size(f)
                sizes.append(total)
            self._seen, self._form = self.core.messages, (forms, sizes)
        return self._form

    def summary(self) -> dict[str, Any]:
        """Counters of the session (``GET /leyline/sessions``)."""
        return {
            "id": self.id,
            "tenant": self.tenant,
            "namespace": self.core.namespace,
            "source": self.source,
            "splice": self.core.splice_enabled,
            "created": self.created,
            "in_flight": self.lock.locked(),
            **Counters.of(self.core.records).as_dict(),
        }

    def detail(self) -> dict[str, Any]:
        """The summary plus every turn's record (``GET /leyline/sessions/{id}``)."""
        return {**self.summary(), "records": [r.model_dump() for r in self.core.records]}


def _shared(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]]) -> int:
    """Leading messages ``a`` and ``b`` have in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class SessionRegistry:
    """Live sessions by :class:`SessionKey`.

    Args:
        new_core: builds the ``SessionCore`` of a new session from its public id and namespace.
        max_sessions: live sessions kept; past it the least recently used idle one is dropped.
        min_shared: see ``_match``.
    """

    def __init__(
        self,
        new_core: Callable[[str, str], SessionCore],
        *,
        max_sessions: int = 1024,
        min_shared: float = MIN_SHARED,
    ):
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if not 0.0 < min_shared <= 1.0:
            raise ValueError(f"min_shared must be in (0, 1], got {min_shared}")
        self._new_core = new_core
        self._max = max_sessions
        self._min_shared = min_shared
        self._sessions: dict[SessionKey, ProxySession] = {}
        self._lock = threading.Lock()
        self.retired = Counters()
        self._retired_by_tenant: dict[str, Counters] = {}
        self.created = 0
        self._created_by_tenant: Counter[str] = Counter()

    def resolve(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        header: str | None = None,
        user: str | None = None,
        tenant: str = DEFAULT_TENANT,
        cache_salt: str | None = None,
    ) -> ProxySession:
        """The session a request belongs to (created if needed); see the module docstring.

        ``cache_salt`` is the salt a new session starts with and the one an anonymous match
        requires; a named session's salt is set by its turn (``SessionCore.set_cache_salt``).
        """
        cache_salt = cache_salt or None
        with self._lock:
            if header or user:
                key = (
                    SessionKey(tenant, "header", header)
                    if header
                    else SessionKey(tenant, "user", user or "")
                )
                session = self._sessions.get(key) or self._add(key, key.kind, cache_salt)
            else:
                session = self._match(messages, tenant, cache_salt) or self._add(
                    SessionKey(tenant, "anon", uuid.uuid4().hex), "new", cache_salt
                )
            session.last_used = time.monotonic()
            return session

    def _match(
        self, messages: Sequence[Mapping[str, Any]], tenant: str, cache_salt: str | None
    ) -> ProxySession | None:
        """The anonymous session an unnamed request continues, if any.

        A candidate is an anonymous session of the same tenant and ``cache_salt`` with no turn in
        flight whose committed history is *shorter* than the request (a session that has
        already reached this request's length took an equal request before: the request is
        another run of the same agent, never merged into it). Messages are compared in their
        ``match_form``. The candidate sharing the longest leading run of messages (measured in
        characters) wins, an exact prefix before an edited history; an edited history (the agent
        rewrote an earlier message) qualifies only when the shared part is at least
        ``min_shared`` of the session's history. A tie means identical histories (two runs of
        one agent in lockstep): it goes to the least recently used, so runs that alternate turns
        keep their own sessions.
        """
        incoming: list[dict[str, Any]] | None = None
        best: tuple[tuple[int, bool, float], ProxySession] | None = None
        for s in self._sessions.values():
            if s.named or s.tenant != tenant or s.core.cache_salt != cache_salt:
                continue
            if s.lock.locked() or not 0 < len(s.core.messages) < len(messages):
                continue
            if incoming is None:
                incoming = [match_form(m) for m in messages]
            forms, sizes = s.committed_form()
            n = _shared(forms, incoming)
            if n == 0:
                continue
            exact = n == len(forms)
            if not exact and sizes[n - 1] < self._min_shared * sizes[-1]:
                continue
            rank = (sizes[n - 1], exact, -s.last_used)
            if best is None or rank > best[0]:
                best = (rank, s)
        if best is None:
            return None
        session = best[1]
        if session.source == "new":
            session.source = "prefix"
        return session

    def _add(self, key: SessionKey, source: Source, cache_salt: str | None) -> ProxySession:
        core = self._new_core(key.public_id, key.namespace)
        core.cache_salt = cache_salt
        session = ProxySession(key, core, source)
        self._sessions[key] = session
        self.created += 1
        self._created_by_tenant[key.tenant] += 1
        idle = sorted(
            (s for s in self._sessions.values() if s is not session and not s.lock.locked()),
            key=lambda s: s.last_used,
        )
        for old in idle[: max(0, len(self._sessions) - self._max)]:
            del self._sessions[old.key]
            counters = Counters.of(old.core.records)
            self.retired.merge(counters)
            self._retired_by_tenant.setdefault(old.tenant, Counters()).merge(counters)
        return session

    def get(self, session_id: str, tenant: str = DEFAULT_TENANT) -> ProxySession | None:
        """The live session of ``tenant`` whose public id is ``session_id``."""
        with self._lock:
            for s in self._sessions.values():
                if s.tenant == tenant and s.id == session_id:
                    return s
            return None

    def sessions(self, tenant: str | None = None) -> list[ProxySession]:
        """Live sessions (of ``tenant`` only, when given)."""
        with self._lock:
            return [s for s in self._sessions.values() if tenant is None or s.tenant == tenant]

    def created_in(self, tenant: str | None = None) -> int:
        """Sessions ever created (in ``tenant``, when given)."""
        return self.created if tenant is None else self._created_by_tenant[tenant]

    def totals(self, tenant: str | None = None) -> Counters:
        """Counters over every session ever served, live and dropped (of ``tenant``)."""
        out = Counters()
        out.merge(self.retired if tenant is None else self._retired_by_tenant.get(tenant, out))
        for s in self.sessions(tenant):
            out.merge(Counters.of(s.core.records))
        return out


class TraceRecorder:
    """``--record DIR``: one JSONL file per session, one line per finished turn.

    Line: ``{"session": id, "tenant": t, "turn": n, "messages": [...], "tools": [...]}`` with the
    message list as the agent sent it (before the policy). ``leyline_agent.traces.load(DIR)``
    reads each file back as one trace (the JSONL loader's one-request-per-line shape). The file
    name is ``<tenant>+<public id>``, each percent-escaped (reversible, and ``+`` never occurs in
    an escaped part, so two sessions never share a file), e.g. ``default+dg-1a2b-none-config``;
    past 160 characters it is cut and 16 hex digits of its SHA-256 are appended.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, key: SessionKey) -> Path:
        stem = f"{_escape(key.tenant)}+{_escape(key.public_id)}"  # "+" is always escaped
        if len(stem) > 160:
            stem = stem[:140] + "-" + hashlib.sha256(stem.encode()).hexdigest()[:16]
        return self.directory / (stem + ".jsonl")

    def write(
        self,
        key: SessionKey,
        turn: int,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None,
    ) -> None:
        line = {"session": key.public_id, "tenant": key.tenant, "turn": turn}
        line["messages"] = list(messages)
        if tools:
            line["tools"] = list(tools)
        with self.path(key).open("a", encoding="utf-8") as f:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
