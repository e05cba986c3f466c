"""The proxy's backends: one or several ``leyline serve``, each session pinned to one.

Routing (``routing.py``): a new session goes to the first backend of its namespace's rendezvous
order (``rank(urls, extra_key)``) that is up, and stays there: its KV, hence its splices and its
requests, live on that backend alone. When its backend is down the session *fails over* to the
next one up in the same order (``SessionCore.move``): the turn there is a cold prefill, and an
edited turn counts as a splice miss with reason ``failover``. A session never moves back when its
first backend returns (its KV is now where it moved; moving again would cost another cold
prefill); new sessions go to their home again.

Health: ``run_health_checks`` polls every backend's ``GET /health`` each ``interval`` seconds
(a backend is down after ``fail_after`` failed polls in a row, up again after one answer 200);
a request that cannot connect (``httpx.ConnectError``: nothing reached the backend) marks its
backend down at once (``mark_down``). While every backend is down, sessions stay where they are
and requests fail as they do with one backend (502).

Counters per backend for ``/metrics``: requests forwarded, errors (connection failures, timeouts
and 5xx answers), sessions that failed over away from it, and the up gauge.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx

from leyline_agent.client import LeylineClient, auth_headers
from leyline_agent.routing import normalize, pick, rank

if TYPE_CHECKING:
    from leyline_agent.proxy.sessions import ProxySession

log = logging.getLogger(__name__)

DEFAULT_HEALTH_INTERVAL = 5.0  # seconds between two polls of a backend's /health
HEALTH_TIMEOUT = 5.0  # seconds one poll may take


@dataclass
class Backend:
    """One ``leyline serve``: its clients (sync for splices, async for chat) and counters."""

    url: str
    client: LeylineClient
    http: httpx.AsyncClient
    up: bool = True
    requests: int = 0
    errors: int = 0
    failovers: int = 0  # sessions moved away from it
    failed_polls: int = 0  # consecutive failed health polls
    last_error: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, *, error: bool = False) -> None:
        """One request forwarded; a success also proves the backend up."""
        with self.lock:
            self.requests += 1
            self.errors += error
            if not error:
                self.up, self.failed_polls = True, 0


class BackendPool:
    """The backends of one proxy and which session is on which.

    Args:
        urls: backend base URLs (without ``/v1``), at least one, each once.
        timeout: httpx timeout of every upstream request.
        api_key: the backends' key (``leyline serve --api-key``), sent upstream.
        fail_after: failed health polls in a row before a backend is marked down.

    Raises:
        ValueError: no URL, or one given twice.
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout: httpx.Timeout,
        api_key: str | None = None,
        fail_after: int = 2,
        gateway: bool | None = None,
    ) -> None:
        rank(urls, "")  # raises on no URL or a URL given twice
        self.urls = [normalize(u) for u in urls]
        self.fail_after = fail_after
        self.backends = {
            u: Backend(
                u,
                LeylineClient(u, timeout=timeout, api_key=api_key, gateway=gateway),
                httpx.AsyncClient(base_url=u, timeout=timeout, headers=auth_headers(api_key)),
            )
            for u in self.urls
        }
        self._lock = threading.Lock()

    @property
    def first(self) -> Backend:
        """The first backend given (``GET /v1/models`` and the context length come from it)."""
        return self.backends[self.urls[0]]

    def up(self) -> list[Backend]:
        return [b for b in self.backends.values() if b.up]

    def route(self, session: ProxySession) -> Backend:
        """The backend of ``session``'s next turn: its own while up; else (or for a new session)
        the first one up in its namespace's rendezvous order, moving the session there
        (``SessionCore.move``) when it was on another. Every backend down: its own (or its home)."""
        with self._lock:
            current = session.backend
            if current is not None and self.backends[current].up:
                return self.backends[current]
            key = session.core.placement.own
            url = pick(self.urls, key, lambda u: self.backends[u].up) or current
            url = url or rank(self.urls, key)[0]
            backend = self.backends[url]
            if current is not None and url != current:
                old = self.backends[current]
                old.failovers += 1
                why = f"backend {current} down ({old.last_error}); moved to {url}"
                session.core.move(backend.client, why)
                log.warning("session %s: %s", session.id, why)
            elif current is None:
                session.core.placement.bind(backend.client)
            session.backend = url
            return backend

    def mark_down(self, backend: Backend, error: BaseException | str) -> None:
        """``backend`` cannot be reached: no session is routed to it until a health poll
        answers again."""
        with self._lock:
            backend.last_error = error if isinstance(error, str) else repr(error)
            if backend.up:
                log.warning("backend %s down: %s", backend.url, backend.last_error)
            backend.up = False

    async def poll(self, backend: Backend) -> bool:
        """One ``GET /health`` of ``backend``; updates its state. True: it answered 200."""
        refused = False  # nothing listens: down at once, without waiting for fail_after polls
        try:
            r = await backend.http.get("/health", timeout=HEALTH_TIMEOUT)
            ok, error = r.status_code == 200, f"/health answered {r.status_code}"
        except httpx.ConnectError as e:
            ok, error, refused = False, repr(e), True
        except httpx.HTTPError as e:
            ok, error = False, repr(e)
        if ok:
            with self._lock:
                if not backend.up:
                    log.warning("backend %s up again", backend.url)
                backend.up, backend.failed_polls = True, 0
            return True
        backend.failed_polls += 1
        if refused or backend.failed_polls >= self.fail_after:
            self.mark_down(backend, error)
        return False

    async def run_health_checks(self, interval: float = DEFAULT_HEALTH_INTERVAL) -> None:
        """Poll every backend each ``interval`` seconds, forever (cancel the task to stop)."""
        while True:
            await asyncio.gather(*(self.poll(b) for b in self.backends.values()))
            await asyncio.sleep(interval)

    async def aclose(self) -> None:
        for b in self.backends.values():
            await b.http.aclose()
            b.client.close()
