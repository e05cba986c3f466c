"""Where a session's KV lives: its backend, its cache namespaces, its salt, shared or private.

The backend keys its radix cache by ``(extra_key, cache_salt)`` (SGLang's ``RadixKey``). A
session has two ``extra_key`` values, spelled here only:

=====================  ===========================================================================
``own``                the session's own namespace, ``leyline:<session_id>`` in process, or
                       ``leyline:<tenant>:<kind>:<name>[:<conversation>]`` behind the proxy
                       (``SessionKey``);
                       amortized (spliced) KV lives only here; routing, pin owner and forks use it
``shared``             the tenant's namespace of exact KV, ``leyline:<tenant>:shared``: sessions
                       with the same prompt prefix prefill it once
=====================  ===========================================================================

State machine (``share_exact``, the default): a session is *shared* (its requests use
``shared``) until its first splice; that splice is sent with ``extra_key`` = shared and
``target_extra_key`` = own, so the server copies the unchanged prefix into ``own`` and builds the
edited sequence there; from then on the session is *private* (every request and splice in
``own``). A new salt or a move to another backend makes it shared again (nothing private is
reachable there). ``share_exact=False``: private from the first request. Pure Python, no I/O.
"""

from __future__ import annotations

from urllib.parse import quote

from leyline_agent.client import LeylineClient
from leyline_agent.wire import Namespace

PREFIX = "leyline"
DEFAULT_TENANT = "default"


def escape(text: str) -> str:
    """Percent-escape everything but ``A-Za-z0-9_.-~`` (reversible; the result has no ``:``)."""
    return quote(text, safe="")


def namespace(*parts: str) -> str:
    """``leyline:<part>:<part>...``: the spelling of every namespace (parts already escaped
    where they must be)."""
    return ":".join((PREFIX, *parts))


def shared_namespace(tenant: str = DEFAULT_TENANT) -> str:
    """The tenant's namespace of exact KV: three parts, so no session's own namespace (two in
    process, four or five behind the proxy) is it."""
    return namespace(escape(tenant), "shared")


DEFAULT_SHARED_NAMESPACE = shared_namespace()  # leyline:default:shared: API and proxy share it


class Placement:
    """Where one session's KV lives (module docstring).

    Args:
        client: the session's backend.
        own: the session's own ``extra_key``.
        shared: the tenant's shared ``extra_key``; must differ from ``own`` when sharing.
        salt: SGLang's ``cache_salt`` (None: none); one salt for every request and splice.
        share_exact: shared until the first splice (False: private from the start).

    Raises:
        ValueError: ``share_exact`` and ``shared == own``.
    """

    def __init__(
        self,
        client: LeylineClient,
        own: str,
        *,
        shared: str = DEFAULT_SHARED_NAMESPACE,
        salt: str | None = None,
        share_exact: bool = True,
    ) -> None:
        if share_exact and shared == own:
            raise ValueError(f"the shared namespace {shared!r} is the session's own")
        self.client = client
        self.own, self.shared, self.salt = own, shared, salt or None
        self.share_exact = share_exact
        # NOTE: private: the session's KV is in ``own`` (it spliced or was forked, or sharing is
        # off); False: in ``shared``, exact KV only.
        self.private = not share_exact
        # NOTE: the LoRA adapter the session's requests name (SGLang keys their radix path by
        # extra_key + lora_id): its splices name it too (None: the base model)
        self.adapter: str | None = None
        self._moved: str | None = None  # why the session moved to another backend
        self.worker: str | None = None  # behind a gateway: the worker that answered last

    @property
    def extra_key(self) -> str:
        """The ``extra_key`` of the session's next request: ``own`` once private, else
        ``shared``."""
        return self.own if self.private else self.shared

    @property
    def request(self) -> Namespace:
        """The namespace ``(extra_key, cache_salt)`` of the session's next request."""
        return Namespace(self.extra_key, self.salt)

    def splice_target(self) -> str | None:
        """A splice's ``target_extra_key``: ``own`` while shared (the edited sequence is built
        there, the shared source untouched), None once private (in place)."""
        return None if self.private else self.own

    def spliced(self) -> None:
        """A splice succeeded: the edited sequence is in ``own``."""
        self.private = True

    def set_salt(self, salt: str | None) -> bool:
        """Use ``salt`` from now on; True when it changed (another namespace: nothing cached so
        far is reachable in it, so the caller forgets the session's tokens). Shared again."""
        salt = salt or None
        if salt == self.salt:
            return False
        self.salt, self.private = salt, not self.share_exact
        return True

    def set_adapter(self, adapter: str | None) -> bool:
        """Use the LoRA ``adapter`` from now on (None: the base model); True when it changed:
        the backend keys an adapter's KV apart from the base model's and every other adapter's,
        so, as with a new salt, nothing cached so far is reachable. Shared again."""
        adapter = adapter or None
        if adapter == self.adapter:
            return False
        self.adapter, self.private = adapter, not self.share_exact
        return True

    def bind(self, client: LeylineClient) -> None:
        """The session's first backend (or its fork parent's), before it holds anything."""
        self.client = client

    def move_to(self, client: LeylineClient, why: str) -> None:
        """Continue on ``client``, which holds nothing of this session (the proxy's failover):
        shared again; ``take_moved`` answers ``why`` once."""
        self.client, self._moved = client, why
        self.private = not self.share_exact

    @property
    def moved(self) -> bool:
        """The session moved and its next turn has not yet been told (``take_moved``)."""
        return self._moved is not None

    def take_moved(self) -> str | None:
        """Why the session moved since the last call (None: it did not)."""
        moved, self._moved = self._moved, None
        return moved

    def adopt(self, salt: str | None, private: bool) -> None:
        """A fork's state: the parent's salt; private when the parent's KV was copied."""
        self.salt, self.private = salt, private
