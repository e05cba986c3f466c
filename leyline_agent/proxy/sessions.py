"""The proxy's sessions: which conversation a chat-completions request continues.

Resolution, in order:

1. the ``X-Leyline-Session`` header (the session id is the header's value);
2. the OpenAI ``user`` field (the session id is ``user:<value>``);
3. the live anonymous session whose committed message list (what its last finished turn received)
   is the longest prefix of the incoming list; ties go to the most recently used;
4. otherwise a new anonymous session (a random id).

Named sessions (1, 2) are never matched by prefix, so an anonymous agent cannot continue them.
Every session owns a :class:`SessionCore` (its backend namespace ``leyline:<id>``) and an
``asyncio.Lock``: the turns of one session run one at a time (``begin`` → request → ``finish``),
different sessions concurrently. The registry's own table is guarded by a ``threading.Lock``.
Past ``max_sessions`` the least recently used idle session is dropped; its counters are kept in
``SessionRegistry.retired`` so that totals never go down.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from leyline_agent.session import SessionCore, TurnRecord

SESSION_HEADER = "X-Leyline-Session"
Source = Literal["header", "user", "prefix", "new"]


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

    core: SessionCore
    source: Source
    named: bool
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    warned: bool = False  # logged that the backend's prompt differs from the rendered one

    @property
    def id(self) -> str:
        return self.core.session_id

    def summary(self) -> dict[str, Any]:
        """Counters of the session (``GET /leyline/sessions``)."""
        return {
            "id": self.id,
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


def _is_prefix(prefix: Sequence[Mapping[str, Any]], messages: Sequence[Mapping[str, Any]]) -> bool:
    return 0 < len(prefix) <= len(messages) and all(
        a == b for a, b in zip(prefix, messages, strict=False)
    )


class SessionRegistry:
    """Live sessions by id.

    Args:
        new_core: builds the ``SessionCore`` of a new session from its id.
        max_sessions: live sessions kept; past it the least recently used idle one is dropped.
    """

    def __init__(self, new_core: Callable[[str], SessionCore], *, max_sessions: int = 1024):
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self._new_core = new_core
        self._max = max_sessions
        self._sessions: dict[str, ProxySession] = {}
        self._lock = threading.Lock()
        self.retired = Counters()
        self.created = 0

    def resolve(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        header: str | None = None,
        user: str | None = None,
    ) -> ProxySession:
        """The session a request belongs to (created if needed); see the module docstring."""
        with self._lock:
            if header or user:
                sid, source = (header, "header") if header else (f"user:{user}", "user")
                session = self._sessions.get(sid) or self._add(sid, source, named=True)
            else:
                session = self._match(messages) or self._add(uuid.uuid4().hex, "new", named=False)
            session.last_used = time.monotonic()
            return session

    def _match(self, messages: Sequence[Mapping[str, Any]]) -> ProxySession | None:
        best: ProxySession | None = None
        for s in self._sessions.values():
            if s.named or not _is_prefix(s.core.messages, messages):
                continue
            if best is None or (len(s.core.messages), s.last_used) > (
                len(best.core.messages),
                best.last_used,
            ):
                best = s
        if best is not None and best.source == "new":
            best.source = "prefix"
        return best

    def _add(self, sid: str, source: Source, *, named: bool) -> ProxySession:
        session = ProxySession(self._new_core(sid), source, named)
        self._sessions[sid] = session
        self.created += 1
        idle = sorted(
            (s for s in self._sessions.values() if s is not session and not s.lock.locked()),
            key=lambda s: s.last_used,
        )
        for old in idle[: max(0, len(self._sessions) - self._max)]:
            del self._sessions[old.id]
            self.retired.merge(Counters.of(old.core.records))
        return session

    def get(self, sid: str) -> ProxySession | None:
        with self._lock:
            return self._sessions.get(sid)

    def sessions(self) -> list[ProxySession]:
        with self._lock:
            return list(self._sessions.values())

    def totals(self) -> Counters:
        """Counters over every session ever served (live and dropped)."""
        out = Counters()
        out.merge(self.retired)
        for s in self.sessions():
            out.merge(Counters.of(s.core.records))
        return out


class TraceRecorder:
    """``--record DIR``: one JSONL file per session, one line per finished turn.

    Line: ``{"session": id, "turn": n, "messages": [...], "tools": [...]}`` with the message list
    as the agent sent it (before the policy). ``leyline_agent.traces.load(DIR)`` reads each file
    back as one trace (the JSONL loader's one-request-per-line shape).
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, session_id: str) -> Path:
        return self.directory / (re.sub(r"[^A-Za-z0-9._-]", "_", session_id) + ".jsonl")

    def write(
        self,
        session_id: str,
        turn: int,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None,
    ) -> None:
        line = {"session": session_id, "turn": turn, "messages": list(messages)}
        if tools:
            line["tools"] = list(tools)
        with self.path(session_id).open("a", encoding="utf-8") as f:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
