"""``runinfo.backend_info``: a slow probe is retried, not read as "no Leyline".

The backend is an ``httpx.MockTransport`` (a fake: a server that times out on demand cannot be
made to do so on cue); every test name says so.
"""

from __future__ import annotations

import httpx

from leyline_agent.runinfo import PROBE_TIMEOUTS, backend_info

MODEL_INFO = {"model_path": "/m", "load_format": "auto", "model_type": "llama"}


def _client(stats_timeouts: int, stats_status: int = 200) -> tuple[httpx.Client, list[float]]:
    """A fake backend whose ``/leyline/stats`` times out ``stats_timeouts`` times first; the
    list collects each stats attempt's read timeout."""
    seen: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_model_info":
            return httpx.Response(200, json=MODEL_INFO)
        seen.append(request.extensions["timeout"]["read"])
        if len(seen) <= stats_timeouts:
            raise httpx.ReadTimeout("busy", request=request)
        return httpx.Response(stats_status, json={})

    return httpx.Client(base_url="http://backend", transport=httpx.MockTransport(handler)), seen


def test_backend_info_fake_transport_retries_a_timed_out_stats_probe() -> None:
    http, seen = _client(stats_timeouts=1)
    info = backend_info(http)
    assert info["leyline"] is True and "leyline_error" not in info
    assert seen == list(PROBE_TIMEOUTS[:2])
    assert info["load_format"] == "auto" and info["model_type"] == "llama"


def test_backend_info_fake_transport_gives_up_after_every_timeout() -> None:
    http, seen = _client(stats_timeouts=len(PROBE_TIMEOUTS))
    info = backend_info(http)
    assert info["leyline"] is False
    assert "ReadTimeout" in info["leyline_error"]
    assert seen == list(PROBE_TIMEOUTS)


def test_backend_info_fake_transport_404_is_no_leyline_without_retry() -> None:
    http, seen = _client(stats_timeouts=0, stats_status=404)
    info = backend_info(http)
    assert info["leyline"] is False and "leyline_error" not in info
    assert seen == [PROBE_TIMEOUTS[0]]
