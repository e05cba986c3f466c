"""Session-affine routing over several backends: rendezvous (highest-random-weight) hashing.

Every session has a cache namespace (its ``extra_key``: ``leyline:<tenant>:<kind>:<name>`` in the
proxy, ``leyline:<session_id>`` in ``SessionCore``); its KV lives on one backend, so its splices
and requests must all reach that one. ``rank(backends, key)`` orders the backends by
``score(backend, key)``, a 64-bit hash of the pair; the first is the session's home, the others are
its failover order. Properties (tested in ``tests/test_routing.py``):

- stable: the order depends on the backends and the key only (no process seed, no state);
- minimal movement: removing a backend moves only the sessions whose home it was, and each of
  them to its own second choice; adding one moves only the sessions it now wins;
- even spread: every backend is the home of about ``1/len(backends)`` of the keys.

Pure Python, no I/O; health and stickiness live with the caller (``proxy/backends.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Sequence


def normalize(url: str) -> str:
    """A backend URL as it is hashed and labelled: without trailing ``/``."""
    return url.rstrip("/")


def score(backend: str, key: str) -> int:
    """The rendezvous weight of ``backend`` for ``key``: the first 8 bytes of
    SHA-256(``backend`` NUL ``key``), an unsigned 64-bit integer."""
    digest = hashlib.sha256(f"{normalize(backend)}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def rank(backends: Sequence[str], key: str) -> list[str]:
    """``backends`` from the home of ``key`` to its last failover choice (highest score first;
    a tie, which needs a 64-bit collision, goes to the smaller URL).

    Raises:
        ValueError: no backend, or one given twice.
    """
    urls = [normalize(b) for b in backends]
    if not urls:
        raise ValueError("no backend to route to")
    if len(set(urls)) != len(urls):
        raise ValueError(f"a backend is given twice: {list(backends)}")
    return sorted(urls, key=lambda b: (-score(b, key), b))


def home(backends: Sequence[str], key: str) -> str:
    """The backend that holds ``key``'s KV when every backend is up: ``rank(...)[0]``."""
    return rank(backends, key)[0]


def pick(
    backends: Sequence[str], key: str, up: Collection[str] | Callable[[str], bool]
) -> str | None:
    """The first backend of ``rank(backends, key)`` that is up (``up``: a set of URLs or a
    predicate); None when every backend is down."""
    is_up = up if callable(up) else up.__contains__
    return next((b for b in rank(backends, key) if is_up(b)), None)
