"""The proxy's sessions: which conversation a chat-completions request continues.

A session's identity is ``SessionKey(tenant, kind, name, conversation)`` (``identity.py``); the
tenant is the caller's (see ``auth.py``; ``default`` without keys). A request's keys are
``identity.session_keys(body, headers)``. Resolution, in order:

1. the ``X-Leyline-Session`` header: kind ``header``, the name is the header's value;
2. the body's ``prompt_cache_key``: kind ``cache_key``, the name is its value;
3. otherwise the conversation is told apart by its history: the live session of the same tenant,
   ``cache_salt`` and scope whose committed message list (what its last finished turn received)
   shares the longest prefix with the incoming one (``matching.best_match``); the scope is the
   body's ``user`` (an end user: each of the user's conversations is a session of kind ``user``
   named by the user and a random conversation id) or, without one, anonymous;
4. otherwise a new session in that scope (kind ``user``, or ``anon`` with a random name).

A retry (``SessionKeys.retry``: the OpenAI clients' retry count, sent again after a timeout or a
5xx) without a session key goes, before 3, to the session of its scope whose latest request (in
flight or finished) had exactly its messages: it waits for that turn and repeats it (a full hit,
no splice), instead of starting a second session beside it.

``user`` never merges two conversations: a chat front end that sends its user's id on every
request (LibreChat) gets one session per conversation, not one per user. Named sessions (1, 2)
are never matched by history, and a user's conversations are matched only within that user.
Every session owns a :class:`SessionCore` and an ``asyncio.Lock``: the turns of one session run
one at a time (``begin`` → request → ``finish``), different sessions concurrently. The
registry's own table is guarded by a ``threading.Lock``. Past ``max_sessions`` the least recently
used idle session is dropped (as is one ended by ``remove``, ``DELETE /leyline/sessions/{id}``);
its totals are kept in ``SessionRegistry.retired`` (and per tenant) so that totals never go down,
and ``on_drop`` is called with it (the proxy releases its pins).

A request forking a new session (``fresh``) is never matched to an existing one.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from leyline_agent.accounting import Totals
from leyline_agent.proxy.auth import DEFAULT_TENANT
from leyline_agent.proxy.identity import SessionKey, SessionKeys, match_form
from leyline_agent.proxy.matching import MIN_SHARED, best_match
from leyline_agent.proxy.session_record import PinError, ProxySession, Source
from leyline_agent.session import SessionCore

__all__ = ["PinError", "ProxySession", "SessionRegistry", "Source"]


# how a session was found: its named key's kind; ``user``: a conversation in a user's scope;
# ``new``/``prefix``: anonymous, created / continued since by its history
class SessionRegistry:
    """Live sessions by :class:`SessionKey`.

    Args:
        new_core: builds the ``SessionCore`` of a new session from its key (public id, own and
            shared namespaces) and the ``cache_salt`` it starts with.
        max_sessions: live sessions kept; past it the least recently used idle one is dropped.
        min_shared: see ``_match``.
        on_drop: called with every session dropped or removed, outside the registry's lock.
    """

    def __init__(
        self,
        new_core: Callable[[SessionKey, str | None], SessionCore],
        *,
        max_sessions: int = 1024,
        min_shared: float = MIN_SHARED,
        on_drop: Callable[[ProxySession], None] | None = None,
    ):
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if not 0.0 < min_shared <= 1.0:
            raise ValueError(f"min_shared must be in (0, 1], got {min_shared}")
        self._new_core = new_core
        self._max = max_sessions
        self._min_shared = min_shared
        self._on_drop = on_drop
        self._sessions: dict[SessionKey, ProxySession] = {}
        self._lock = threading.Lock()
        self.retired = Totals()
        self._retired_by_tenant: dict[str, Totals] = {}
        self.created = 0
        self._dropped: list[ProxySession] = []  # dropped under the lock, notified after it
        self._created_by_tenant: Counter[str] = Counter()

    def resolve(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        header: str | None = None,
        cache_key: str | None = None,
        user: str | None = None,
        retry: bool = False,
        tenant: str = DEFAULT_TENANT,
        cache_salt: str | None = None,
        fresh: bool = False,
    ) -> ProxySession:
        """The session a request belongs to (created if needed); see the module docstring.

        ``header``, ``cache_key``, ``user``, ``retry``: the request's ``SessionKeys`` (pass
        ``**session_keys(body, headers)._asdict()``). ``cache_salt`` is the salt a new session
        starts with and the one a match by history requires; a named session's salt is set by
        its turn (``SessionCore.set_cache_salt``). ``fresh``: a request without a session key
        starts a new session (a fork) in its scope, never matched.
        """
        cache_salt = cache_salt or None
        with self._lock:
            key = self._named_key(SessionKeys(header, cache_key, user), tenant)
            if key is not None:
                source: Source = "header" if key.kind == "header" else "cache_key"
                session = self._sessions.get(key) or self._add(key, source, cache_salt)
            else:
                found = None
                if retry and not fresh:
                    found = self._retried(messages, tenant, cache_salt, user)
                if found is None and not fresh:
                    found = self._match(messages, tenant, cache_salt, user)
                if found is None and user:
                    new = SessionKey(tenant, "user", user, uuid.uuid4().hex)
                    found = self._add(new, "user", cache_salt)
                session = found or self._add(
                    SessionKey(tenant, "anon", uuid.uuid4().hex), "new", cache_salt
                )
            session.last_used = time.monotonic()
            session.requested = messages
            dropped, self._dropped = self._dropped, []
        self._notify(dropped)
        return session

    @staticmethod
    def _named_key(keys: SessionKeys, tenant: str) -> SessionKey | None:
        """The key a request names its session by (the header, else ``prompt_cache_key``)."""
        if keys.header:
            return SessionKey(tenant, "header", keys.header)
        if keys.cache_key:
            return SessionKey(tenant, "cache_key", keys.cache_key)
        return None

    def named(
        self,
        *,
        header: str | None = None,
        cache_key: str | None = None,
        user: str | None = None,
        retry: bool = False,
        tenant: str = DEFAULT_TENANT,
    ) -> ProxySession | None:
        """The live session a request's session key (header, ``prompt_cache_key``) names, if
        any; ``user`` alone names no session (it is a scope), nor does ``retry``."""
        key = self._named_key(SessionKeys(header, cache_key, user), tenant)
        if key is None:
            return None
        with self._lock:
            return self._sessions.get(key)

    def remove(self, session: ProxySession) -> None:
        """End ``session``: dropped like the least recently used (totals kept, ``on_drop``)."""
        with self._lock:
            if self._sessions.get(session.key) is not session:
                return
            self._retire(session)
        self._notify([session])

    def _retire(self, old: ProxySession) -> None:
        del self._sessions[old.key]
        counters = Totals.of(old.core.records)
        self.retired.merge(counters)
        self._retired_by_tenant.setdefault(old.tenant, Totals()).merge(counters)

    def _notify(self, dropped: list[ProxySession]) -> None:
        if self._on_drop is not None:
            for old in dropped:
                self._on_drop(old)

    def _match(
        self,
        messages: Sequence[Mapping[str, Any]],
        tenant: str,
        cache_salt: str | None,
        user: str | None,
    ) -> ProxySession | None:
        """The session an unnamed request continues, if any (``matching.best_match`` over the
        tenant's idle sessions of this scope, ``user`` or anonymous, with this salt)."""
        candidates = [
            s for s in self._sessions.values()
            if not s.named and s.scope == user and s.tenant == tenant
            and s.core.placement.salt == cache_salt and not s.lock.locked()
        ]  # fmt: skip
        session = best_match(candidates, messages, self._min_shared, repeat=user is not None)
        if session is not None and session.source == "new":
            session.source = "prefix"
        return session

    def _retried(
        self,
        messages: Sequence[Mapping[str, Any]],
        tenant: str,
        cache_salt: str | None,
        user: str | None,
    ) -> ProxySession | None:
        """The session of this scope and salt whose latest request (in flight or finished) had
        exactly these messages (the most recently used of them), if any."""
        incoming: list[dict[str, Any]] | None = None
        best: ProxySession | None = None
        for s in self._sessions.values():
            if s.named or s.scope != user or s.tenant != tenant or s.requested is None:
                continue
            if s.core.placement.salt != cache_salt or len(s.requested) != len(messages):
                continue
            if best is not None and s.last_used <= best.last_used:
                continue
            if incoming is None:
                incoming = [match_form(m) for m in messages]
            if [match_form(m) for m in s.requested] == incoming:
                best = s
        return best

    def _add(self, key: SessionKey, source: Source, cache_salt: str | None) -> ProxySession:
        """A new session; ``source`` is how it was found (a named key's kind, or ``new``)."""
        session = ProxySession(key, self._new_core(key, cache_salt), source)
        self._sessions[key] = session
        self.created += 1
        self._created_by_tenant[key.tenant] += 1
        idle = sorted(
            (s for s in self._sessions.values() if s is not session and not s.lock.locked()),
            key=lambda s: s.last_used,
        )
        for old in idle[: max(0, len(self._sessions) - self._max)]:
            self._retire(old)
            self._dropped.append(old)
        return session

    def get(self, session_id: str, tenant: str = DEFAULT_TENANT) -> ProxySession | None:
        """The live session of ``tenant`` whose public id is ``session_id``."""
        with self._lock:
            for s in self._sessions.values():
                if s.tenant == tenant and s.id == session_id:
                    return s
            return None

    def find(self, ids: Sequence[str], tenant: str = DEFAULT_TENANT) -> ProxySession | None:
        """The live session of ``tenant`` whose public id is the first of ``ids`` to name one
        (see ``identity.public_ids``)."""
        with self._lock:
            by_id = {s.id: s for s in self._sessions.values() if s.tenant == tenant}
        return next((by_id[i] for i in ids if i in by_id), None)

    def sessions(self, tenant: str | None = None) -> list[ProxySession]:
        """Live sessions (of ``tenant`` only, when given)."""
        with self._lock:
            return [s for s in self._sessions.values() if tenant is None or s.tenant == tenant]

    def created_in(self, tenant: str | None = None) -> int:
        """Sessions ever created (in ``tenant``, when given)."""
        return self.created if tenant is None else self._created_by_tenant[tenant]

    def totals(self, tenant: str | None = None) -> Totals:
        """Totals over every session ever served, live and dropped (of ``tenant``)."""
        out = Totals()
        out.merge(self.retired if tenant is None else self._retired_by_tenant.get(tenant, out))
        for s in self.sessions(tenant):
            out.merge(Totals.of(s.core.records))
        return out
