"""Per-breakpoint TTLs through ``POST /v1/messages`` with the real ``anthropic`` SDK, a real proxy
and the shared ``leyline serve``: what Claude Code sends (``ttl: "1h"`` on the tools and the system
prompt, a short TTL on the last message) keeps the 1-hour prefix pinned after the short pin
expired; more than 4 breakpoints are refused in Anthropic's error format before any splice. The
OpenAI route's own case: ``tests/test_sharing_live.py``."""

from __future__ import annotations

import time
from typing import Any

import anthropic
import httpx
import pytest
from test_proxy import new_id, serve_proxy, session_detail
from test_sharing_live import _stats, _system

from leyline_agent.proxy import SESSION_HEADER

pytestmark = pytest.mark.sglang
HOUR = {"type": "ephemeral", "ttl": "1h"}
SHORT = {"type": "ephemeral", "ttl": "4s"}  # NOTE: Anthropic takes "5m" and "1h"; parse_ttl more
TOOL = {"name": "read_file", "description": "Print a file.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}  # fmt: skip


def _client(proxy: str, session: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy, api_key="unused", max_retries=0, timeout=120,
                               default_headers={SESSION_HEADER: session})  # fmt: skip


def test_claude_codes_breakpoints_keep_their_own_ttls(leyline_server: str) -> None:
    sid = new_id("claude-code")
    system: list[Any] = [{"type": "text", "text": _system(400), "cache_control": HOUR}]
    user = {"role": "user", "content": [{"type": "text", "text": "Which test fails?",
                                         "cache_control": SHORT}]}  # fmt: skip
    base = _stats(leyline_server)
    with serve_proxy(leyline_server, "none", share_exact=True) as proxy:
        c = _client(proxy, sid)
        m = c.messages.create(model="default", max_tokens=1, system=system,
                              tools=[{**TOOL, "cache_control": HOUR}],  # type: ignore[list-item]
                              messages=[user])  # type: ignore[list-item]  # fmt: skip
        prompt = m.usage.input_tokens + m.usage.cache_read_input_tokens
        prompt += m.usage.cache_creation_input_tokens or 0
        detail = session_detail(proxy, sid)
        hour, short = detail["pins"]  # the tools render inside the system message: one breakpoint
        assert (hour["ttl_s"], short["ttl_s"]) == (3600, 4)
        assert 500 < hour["pinned_tokens"] < short["pinned_tokens"] < prompt
        stats = _stats(leyline_server)
        assert stats["pins"] - base["pins"] == 2
        assert stats["pinned_slots"] - base["pinned_slots"] == short["pinned_tokens"]
        time.sleep(max(0.0, short["expires_at"] - time.time()) + 0.5)
        after = _stats(leyline_server)
        assert after["pins"] - base["pins"] == 1
        assert after["pinned_slots"] - base["pinned_slots"] == hour["pinned_tokens"]
        assert session_detail(proxy, sid)["pins"] == [hour]
        metrics = httpx.get(f"{proxy}/metrics", timeout=30).text
        assert "leyline_proxy_pins_total 2" in metrics
        # five marked blocks: Anthropic's 400, in its format, before any splice
        five = [{"role": "user" if i % 2 == 0 else "assistant",
                 "content": [{"type": "text", "text": f"m{i}", "cache_control": HOUR}]}
                for i in range(5)]  # fmt: skip
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(model="default", max_tokens=1, messages=five)  # type: ignore[arg-type]
        assert e.value.status_code == 400
        assert e.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        assert "A maximum of 4 blocks with cache_control" in str(e.value)
        assert session_detail(proxy, sid)["turns"] == 1  # nothing reached the backend
    assert _stats(leyline_server)["pins"] == base["pins"]  # the shutdown released the 1-hour pin
