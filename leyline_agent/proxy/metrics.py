"""``GET /metrics``: the proxy's counters in the Prometheus text format (version 0.0.4).

Families ``leyline_proxy_*`` count every session served (dropped ones included);
``leyline_proxy_session_*{session="<id>"}`` count each live session. Times are in seconds. The
token families are the ``accounting.Totals`` of the same name, except
``leyline_proxy_cached_tokens_total``: ``server_cached_tokens`` (the backend's own count, as in
the answers' ``usage.prompt_tokens_details.cached_tokens``).
``leyline_proxy_render_mismatches_total`` / ``leyline_proxy_resyncs_total``: turns whose backend
prompt tokens differed from the rendered ones / after which the session adopted the backend's.
``leyline_proxy_backend_*{backend="<url>"}`` (``render_backends``, proxy-wide): per backend,
requests forwarded, errors, sessions that failed over away from it, live sessions on it, up.
``leyline_proxy_route_*{route="<route>"}`` (``render_routes``): requests, turns and spliced turns
per route. ``leyline_proxy_pin*`` and ``leyline_proxy_fork*`` (``render_retention``, proxy-wide):
pins made (one per breakpoint), refused by the server's cap (429), refused otherwise, replaced by
the session's next marked turn (renewed, or no longer marked), released at session end, markers
whose TTL was clamped or invalid; forks, forks that copied the parent's KV, forks that started
cold.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from leyline_agent.accounting import Totals, TurnRecord
from leyline_agent.proxy.sessions import ProxySession, SessionRegistry

if TYPE_CHECKING:
    from leyline_agent.proxy.backends import Backend, BackendPool
    from leyline_agent.proxy.retention import RetentionCounters

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (Totals field, metric suffix, help); every one is a counter.
_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("turns", "turns_total", "Chat-completion turns answered."),
    ("edited_turns", "edited_turns_total", "Turns whose prompt carried directives."),
    ("policy_edited_turns", "policy_edited_turns_total", "Turns the policy edited."),
    ("spliced_turns", "spliced_turns_total", "Turns whose directives the backend executed."),
    ("splice_misses", "splice_misses_total", "Turns whose splice could not run (re-prefilled)."),
    ("prompt_tokens", "prompt_tokens_total", "Prompt tokens sent to the backend."),
    ("server_cached_tokens", "cached_tokens_total", "Prompt tokens the backend found in its "
     "cache (its own count)."),
    ("reused_tokens", "reused_tokens_total", "Prompt tokens whose KV was reused (prompt minus "
     "prefilled)."),
    ("prefilled_tokens", "prefilled_tokens_total", "Tokens prefilled (request plus splice)."),
    ("splice_prefilled_tokens", "splice_prefilled_tokens_total", "Tokens prefilled by splices."),
    ("rotated_tokens", "rotated_tokens_total", "Cached tokens re-rotated by splices."),
    ("best_reused_tokens", "best_reused_tokens_total", "Upper bound of the reused tokens under "
     "the session's arm: in a session's own namespace the prefix it left there; on a turn in the "
     "shared namespace (shared_turns) the whole prompt, since any session may have cached it (a "
     "loose bound there, not cache lost)."),
    ("shared_turns", "shared_turns_total", "Turns run in the shared namespace (before their "
     "session's first splice)."),
    ("reprefill_tokens", "reprefill_tokens_total", "Tokens a re-prefill would have prefilled: on "
     "a spliced turn, the prompt minus the longest prefix of it that the backend held unchanged "
     "before the splice (the session's previous prompt); on other turns the tokens prefilled."),
    ("saved_tokens", "saved_tokens_total", "Tokens the splices saved: reprefill_tokens minus "
     "prefilled_tokens."),
)  # fmt: skip
_SUMMARIES: tuple[tuple[str, str, str], ...] = (
    ("splice_ms", "splice_seconds", "Time spent in /leyline/splice calls."),
    ("request_ms", "request_seconds", "Time spent in forwarded chat-completion requests."),
)


@dataclass
class ParityCounters:
    """Render parity with the backend, over every turn the proxy answered."""

    render_mismatches: int = 0
    resyncs: int = 0
    failed_turns: int = 0  # recorded turns whose request failed after the cache changed

    def add(self, r: TurnRecord) -> None:
        self.render_mismatches += r.render_mismatch
        self.resyncs += r.resynced
        self.failed_turns += r.error is not None


@dataclass
class RouteCounters:
    """Per route (``/v1/chat/completions``, ``/v1/responses``, ``/v1/completions``, ``forwarded``
    for every other forwarded route): requests received, turns recorded, turns spliced."""

    requests: Counter[str] = field(default_factory=Counter)
    turns: Counter[str] = field(default_factory=Counter)
    spliced: Counter[str] = field(default_factory=Counter)

    def request(self, route: str) -> None:
        self.requests[route] += 1

    def turn(self, route: str, r: TurnRecord) -> None:
        self.turns[route] += 1
        self.spliced[route] += r.spliced


def render_routes(c: RouteCounters) -> str:
    """``leyline_proxy_route_{requests,turns,spliced_turns}_total{route="..."}``."""
    out: list[str] = []
    for counts, suffix, help_ in (
        (c.requests, "requests_total", "Requests received on the route."),
        (c.turns, "turns_total", "Turns recorded on the route."),
        (c.spliced, "spliced_turns_total", "Turns on the route whose directives the backend executed."),
    ):  # fmt: skip
        samples = [(f'{{route="{_label(r)}"}}', n) for r, n in sorted(counts.items())]
        out += _family(f"leyline_proxy_route_{suffix}", "counter", help_, samples)
    return "\n".join(out) + "\n"


_PARITY: tuple[tuple[str, str, str], ...] = (
    ("render_mismatches", "render_mismatches_total", "Turns whose backend prompt tokens differed "
     "from the rendered ones."),
    ("resyncs", "resyncs_total", "Turns after which the session adopted the backend's tokens."),
    ("failed_turns", "failed_turns_total", "Turns recorded after their request failed or was "
     "cut off (the cache had changed)."),
)  # fmt: skip


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _family(name: str, kind: str, help_: str, samples: Iterable[tuple[str, float]]) -> list[str]:
    lines = [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{labels} {_num(value)}" for labels, value in samples]
    return lines


def _modes(c: Totals, extra: str = "") -> list[tuple[str, float]]:
    return [
        (f'{{{extra}mode="amortize"}}', c.directives_amortize),
        (f'{{{extra}mode="forget"}}', c.directives_forget),
    ]


def render(
    registry: SessionRegistry, parity: ParityCounters | None = None, tenant: str | None = None
) -> str:
    """The exposition text for every counter of the registry (and the parity counters);
    sessions and totals of ``tenant`` only, when given (a caller sees its own tenant)."""
    totals = registry.totals(tenant)
    parity = parity or ParityCounters()
    live = [(s.id, Totals.of(s.core.records)) for s in registry.sessions(tenant)]
    out = _family("leyline_proxy_sessions", "gauge", "Live sessions.", [("", len(live))])
    out += _family(
        "leyline_proxy_sessions_created_total",
        "counter",
        "Sessions created.",
        [("", registry.created_in(tenant))],
    )
    for attr, suffix, help_ in _COUNTERS:
        out += _family(f"leyline_proxy_{suffix}", "counter", help_, [("", getattr(totals, attr))])
    for attr, suffix, help_ in _PARITY:
        out += _family(f"leyline_proxy_{suffix}", "counter", help_, [("", getattr(parity, attr))])
    out += _family(
        "leyline_proxy_directives_total", "counter", "Directives sent, by mode.", _modes(totals)
    )
    out += _family(
        "leyline_proxy_splice_misses_by_reason_total",
        "counter",
        "Edited turns whose splice could not run, by reason (not_cached, pool_full, ...).",
        [(f'{{reason="{_label(k)}"}}', v) for k, v in sorted(totals.misses_by_reason.items())],
    )
    for attr, base, help_ in _SUMMARIES:
        name = f"leyline_proxy_{base}"
        count = totals.spliced_turns + totals.splice_misses if attr == "splice_ms" else totals.turns
        out += [f"# HELP {name} {help_}", f"# TYPE {name} summary"]
        out += [f"{name}_sum {_num(getattr(totals, attr) / 1e3)}", f"{name}_count {count}"]
    for attr, suffix, help_ in _COUNTERS:
        out += _family(
            f"leyline_proxy_session_{suffix}",
            "counter",
            f"{help_} Per live session.",
            [(f'{{session="{_label(sid)}"}}', getattr(c, attr)) for sid, c in live],
        )
    out += _family(
        "leyline_proxy_session_splice_seconds_total",
        "counter",
        "Time spent in /leyline/splice calls. Per live session.",
        [(f'{{session="{_label(sid)}"}}', c.splice_ms / 1e3) for sid, c in live],
    )
    out += _family(
        "leyline_proxy_session_directives_total",
        "counter",
        "Directives sent, by mode. Per live session.",
        [s for sid, c in live for s in _modes(c, f'session="{_label(sid)}",')],
    )
    return "\n".join(out) + "\n"


def render_backends(pool: BackendPool, sessions: Iterable[ProxySession]) -> str:
    """The per-backend families (label ``backend="<url>"``) for every backend of ``pool``;
    ``sessions``: the live sessions, counted where they are pinned."""
    on = Counter(s.backend for s in sessions)
    bs = list(pool.backends.values())

    families: tuple[tuple[str, str, str, Callable[[Backend], float]], ...] = (
        ("requests_total", "counter", "Chat-completion requests forwarded to the backend.",
         lambda b: b.requests),
        ("errors_total", "counter", "Requests to the backend that failed: no connection, a "
         "timeout, a 5xx answer.", lambda b: b.errors),
        ("failovers_total", "counter", "Sessions moved away from the backend while it was down.",
         lambda b: b.failovers),
        ("sessions", "gauge", "Live sessions whose KV is on the backend.", lambda b: on[b.url]),
        ("up", "gauge", "1 while the backend takes sessions (health checks and requests), else 0.",
         lambda b: int(b.up)),
    )  # fmt: skip
    out: list[str] = []
    for name, kind, help_, value in families:
        samples = [(f'{{backend="{_label(b.url)}"}}', value(b)) for b in bs]
        out += _family(f"leyline_proxy_backend_{name}", kind, help_, samples)
    return "\n".join(out) + "\n"


_RETENTION: tuple[tuple[str, str, str], ...] = (
    ("pins", "pins_total", "Pins made from cache_control markers, one per breakpoint of a "
     "marked turn whose pin the server accepted (a renewal is a new pin)."),
    ("pins_refused", "pins_refused_total", "Pins refused by the server's cap on pinned slots "
     "(429)."),
    ("pin_errors", "pin_errors_total", "Pins refused otherwise (not cached, unreachable)."),
    ("pins_replaced", "pins_replaced_total", "Pins released by a later marked turn of their "
     "session: renewed, or no longer marked and of no use (not those that expired first)."),
    ("pins_released", "pins_released_total", "Pins released when their session ended (dropped "
     "past max_sessions, or DELETE /leyline/sessions/{id}); replaced pins are not counted here."),
    ("pin_ttl_clamped", "pin_ttl_clamped_total", "cache_control markers whose ttl was above the "
     "server's maximum, 86400 s (pinned for 86400 s)."),
    ("pin_ttl_invalid", "pin_ttl_invalid_total", "cache_control markers whose ttl was malformed "
     "or not positive (pinned for the default 300 s)."),
    ("forks", "forks_total", "Sessions started from another one (X-Leyline-Fork-From)."),
    ("fork_copies", "fork_copies_total", "Forks that copied a private parent's KV."),
    ("fork_misses", "fork_misses_total", "Forks that started cold (copy refused, other salt)."),
)  # fmt: skip


def render_retention(counters: RetentionCounters) -> str:
    """The proxy-wide pin and fork counters."""
    out: list[str] = []
    for attr, suffix, help_ in _RETENTION:
        out += _family(f"leyline_proxy_{suffix}", "counter", help_, [("", getattr(counters, attr))])
    return "\n".join(out) + "\n"
