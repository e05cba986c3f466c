"""The proxy's client keys: ``leyline proxy --api-key KEY[=TENANT]`` and the tenant of a request.

Without keys every request belongs to the tenant ``default`` and nothing is checked. With keys,
every route but ``GET /health`` needs ``Authorization: Bearer KEY`` with one of them; anything
else is answered 401 (OpenAI's error format, ``code: invalid_api_key``) before the body is read,
so a refused request changes nothing. The key's tenant scopes everything the request can reach:
the session it resolves to, the backend namespace, ``/leyline/sessions`` and ``/metrics``.

``KEY=TENANT``: the text after the last ``=`` is the tenant when it is a tenant name
(``[A-Za-z0-9._-]+``); a key alone (or one ending in ``=``, base64 padding) is a tenant of its own,
named ``key-`` plus 12 hex digits of the key's SHA-256. Several keys may share a tenant.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from leyline_agent.placement import DEFAULT_TENANT

TENANT_NAME = re.compile(r"[A-Za-z0-9._-]+")
OPEN_PATHS = frozenset({"/health"})


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def parse_api_key(spec: str) -> tuple[str, str]:
    """``(key, tenant)`` of one ``--api-key`` value (see the module docstring).

    Raises:
        ValueError: an empty key.
    """
    key, sep, tenant = spec.rpartition("=")
    if not (sep and key and TENANT_NAME.fullmatch(tenant)):
        key, tenant = spec, "key-" + _digest(spec).hex()[:12]
    if not key.strip():
        raise ValueError("an API key must not be empty")
    return key, tenant


class ApiKeys:
    """Client keys and their tenants. ``ApiKeys(["k1=alice", "k2=bob"]).tenant("Bearer k1")``.

    Keys are kept as SHA-256 digests only; a lookup hashes the presented key (no comparison of
    the secret itself).

    Raises:
        ValueError: an empty key, or one key given for two tenants.
    """

    def __init__(self, specs: Iterable[str] = ()) -> None:
        self._tenants: dict[bytes, str] = {}
        for spec in specs:
            key, tenant = parse_api_key(spec)
            old = self._tenants.setdefault(_digest(key), tenant)
            if old != tenant:
                raise ValueError(f"one API key is given for two tenants ({old!r}, {tenant!r})")

    def __bool__(self) -> bool:
        return bool(self._tenants)

    @property
    def tenants(self) -> set[str]:
        return set(self._tenants.values())

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant of an ``Authorization`` header value; None when it names no key."""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        return self._tenants.get(_digest(key.strip()))


def _unauthorized(message: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    body = {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    data = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        (b"www-authenticate", b'Bearer realm="leyline"'),
    ]
    return headers, data


class AuthMiddleware:
    """Pure ASGI (streaming and client disconnects pass through untouched): sets
    ``request.state.tenant``, or answers 401 when keys are configured and the request has none
    of them."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tenant: str | None = DEFAULT_TENANT
        if self.keys and scope.get("path") not in OPEN_PATHS:
            authorization = Request(scope).headers.get("authorization")
            tenant = self.keys.tenant(authorization)
            if tenant is None:
                message = (
                    "missing API key: send 'Authorization: Bearer <key>'"
                    if not authorization
                    else "incorrect API key"
                )
                headers, data = _unauthorized(message)
                await send({"type": "http.response.start", "status": 401, "headers": headers})
                await send({"type": "http.response.body", "body": data})
                return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


def tenant_of(request: Any) -> str:
    """The tenant ``AuthMiddleware`` assigned to ``request`` (``default`` without keys)."""
    return getattr(request.state, "tenant", None) or DEFAULT_TENANT
