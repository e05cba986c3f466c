"""Replay traces turn by turn through the arms, one ``SessionCore`` per (level, trace, arm).

Arms (``leyline_agent.arms``), teacher-forced: each turn sends the recorded message list and
generates one token.

Every session has its own namespace (``extra_key``) from its first request (``share_exact=False``:
no tenant-wide shared namespace), so arms and levels never share cache entries: the arms replay
the same traces, and a shared namespace would hand one arm the prefixes another prefilled.
At concurrency level ``c`` the sessions of one level run on a pool of ``c`` threads (sessions run
in parallel; the turns of one session stay in order). With several backends each session runs on
its namespace's home backend (``routing.home``, the proxy's session-affine assignment), its
argmax reference with it.

Argmax reference: on every spliced turn the splice session also sends the same edited prompt to a
second namespace of its own that only ever gets exact prefills (prefix-cached, never spliced), and
compares the first generated token with the spliced one. That doubles the prefill of spliced turns
only; its time is not counted in any arm.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import httpx
import jinja2

from leyline_agent.arms import Arm, arm_switch
from leyline_agent.chat.render import Renderer
from leyline_agent.client import LeylineClient
from leyline_agent.generate_turn import generate_turn
from leyline_agent.messages import flatten
from leyline_agent.policies import Policy, PolicyError, parse_policy
from leyline_agent.replay.spec import ReplaySpec, TurnRow
from leyline_agent.routing import home
from leyline_agent.session import SessionCore
from leyline_agent.traces import Trace
from leyline_agent.wrapper import ConversationWrapper


class LevelResult(NamedTuple):
    level: int
    rows: list[TurnRow]
    wall_s: float


def replay_session(
    client: LeylineClient,
    renderer: Renderer,
    policy: Policy,
    arm: Arm,
    trace: Trace,
    *,
    level: int,
    session_id: str,
    max_turns: int | None = None,
    cap_chars: int | None = None,
    agreement: bool = True,
    on_turn: Callable[[TurnRow], None] | None = None,
) -> list[TurnRow]:
    """Replay one trace through one arm in a fresh namespace; ``cap_chars``: each turn's
    messages cut first (``messages.flatten``: plain text, each message's first N characters).

    A turn that cannot run is skipped (``row.error``, ``row.skip_reason``) and the next one starts
    a fresh prompt: the template or the policy rejects its messages, or the backend refuses the
    request with a 4xx status (a prompt longer than the context, ids out of range).

    Raises:
        httpx.HTTPError: the backend failed a request otherwise (5xx, unreachable, 401/403: the
            backend needs ``--backend-api-key``).
    """
    switch = arm_switch(arm, policy)
    core = SessionCore(
        client,
        ConversationWrapper(renderer, switch.policy),
        session_id=session_id,
        splice=switch.splice,
        share_exact=False,
    )
    reference_ns = f"{core.placement.own}:ref"
    rows: list[TurnRow] = []
    for i, messages in enumerate(trace.turns[:max_turns]):
        if cap_chars is not None:
            messages = flatten(messages, cap_chars)
        try:
            record, _ = generate_turn(core, messages, trace.tools)
        except (jinja2.TemplateError, PolicyError, httpx.HTTPStatusError) as e:
            if isinstance(e, httpx.HTTPStatusError) and (
                not e.response.is_client_error or e.response.status_code in (401, 403)
            ):
                raise  # a server error, or a missing or wrong backend key: not the turn's fault
            core.forget()
            reason, message = skip_reason(e)
            row = TurnRow(
                turn=i, prompt_tokens=0, server_cached_tokens=0, prefilled_tokens=0,
                reused_tokens=0, best_reused_tokens=0, level=level, arm=arm, trace=trace.name,
                error=message, skip_reason=reason, backend=client.base_url,
            )  # fmt: skip
        else:
            row = TurnRow(
                **{**record.model_dump(), "turn": i},
                level=level,
                arm=arm,
                trace=trace.name,
                turn_ms=record.splice_ms + record.request_ms,
                backend=client.base_url,
            )
            if agreement and record.spliced:
                ref = client.generate(core.wrapper.tokens, extra_key=reference_ns, top_logprobs=2)
                row.reference_token = ref.output_ids[0] if ref.output_ids else None
                row.reference_margin = top_margin(ref.meta)
                row.argmax_agree = row.reference_token == record.first_token
        rows.append(row)
        if on_turn is not None:
            on_turn(row)
    return rows


def top_margin(meta: dict[str, Any]) -> float | None:
    """The first output position's top two log-probabilities, their difference in nats, from
    SGLang's ``meta_info["output_top_logprobs"]``; None when it is not there."""
    try:
        first, second = meta["output_top_logprobs"][0][:2]
        return float(first[0]) - float(second[0])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def skip_reason(e: Exception) -> tuple[str, str]:
    """(short reason, message) of a turn that could not run."""
    if isinstance(e, httpx.HTTPStatusError):
        try:
            detail = e.response.json()
            detail = detail.get("error", detail) if isinstance(detail, dict) else detail
            if isinstance(detail, dict):
                detail = detail.get("message", detail)
        except ValueError:
            detail = e.response.text
        return f"HTTP {e.response.status_code}", f"HTTP {e.response.status_code}: {detail}"[:500]
    return type(e).__name__, f"{type(e).__name__}: {e}"


def session_order(
    traces: Sequence[Trace], arms: Sequence[Arm], level: int, seed: int
) -> list[tuple[int, Arm]]:
    """(trace index, arm) pairs: trace-major with the arms interleaved; shuffled (seeded) when
    several sessions run at once, so that no arm systematically starts first."""
    tasks = [(t, a) for t in range(len(traces)) for a in arms]
    if level > 1:
        random.Random(seed * 1000 + level).shuffle(tasks)
    return tasks


def route(clients: Sequence[LeylineClient], session_id: str) -> LeylineClient:
    """The client of the backend that is home to ``session_id``'s namespace (``SessionCore``'s
    ``leyline:<session_id>``), by rendezvous hashing as in the proxy."""
    by_url = {c.base_url: c for c in clients}
    return by_url[home(list(by_url), f"leyline:{session_id}")]


def run_level(
    clients: Sequence[LeylineClient],
    renderer: Renderer,
    policy: Policy,
    traces: Sequence[Trace],
    spec: ReplaySpec,
    level: int,
    run_id: str,
    on_turn: Callable[[TurnRow], None] | None = None,
) -> LevelResult:
    """Every (trace, arm) session of one concurrency level, ``level`` at a time, each on its
    home backend among ``clients`` (see ``route``)."""
    tasks = session_order(traces, spec.arms, level, spec.seed)
    sid = [f"replay-{run_id}-c{level}-t{t}-{arm}" for t, arm in tasks]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=level, thread_name_prefix=f"replay-c{level}") as pool:
        futures = [
            pool.submit(
                replay_session,
                route(clients, sid[i]),
                renderer,
                policy,
                arm,
                traces[t],
                level=level,
                session_id=sid[i],
                max_turns=spec.max_turns,
                cap_chars=spec.cap_chars,
                agreement=spec.agreement,
                on_turn=on_turn,
            )  # fmt: skip
            for i, (t, arm) in enumerate(tasks)
        ]
        rows = [row for f in futures for row in f.result()]
    return LevelResult(level, rows, time.perf_counter() - t0)


def replay(
    spec: ReplaySpec,
    client: LeylineClient | Sequence[LeylineClient],
    renderer: Renderer,
    traces: Sequence[Trace],
    on_turn: Callable[[TurnRow], None] | None = None,
) -> list[LevelResult]:
    """Run every level of ``spec`` on ``traces``, in order; ``client``: the backend, or several
    (each session on its home backend, see ``route``).

    Raises:
        PolicyError: ``spec.policy`` is not a valid policy spec.
        httpx.HTTPError: the backend failed a request.
    """
    policy = parse_policy(spec.policy)
    run_id = uuid.uuid4().hex[:8]
    clients = [client] if isinstance(client, LeylineClient) else list(client)
    return [
        run_level(clients, renderer, policy, traces, spec, level, run_id, on_turn)
        for level in spec.concurrency
    ]


def total_turns(traces: Sequence[Trace], spec: ReplaySpec) -> int:
    """Turns the whole run replays (for the progress bar)."""
    per_arm = sum(len(t.turns[: spec.max_turns]) for t in traces)
    return per_arm * len(spec.arms) * len(spec.concurrency)
