"""Engine processes that die or hang under the router (issue 13 items 1 and 2): a stream cut by an
engine SIGKILL ends with an OpenAI-shaped error event and an aborted connection (the openai SDK
raises instead of returning a short answer); a SIGSTOPped engine costs each request at most the
first-byte budget before it fails over, and its circuit breaker stops sending it traffic."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import httpx
import openai
import pytest

from router.config import load_config
from router.service import build_router_app
from sim.fleet import PROFILES, Fleet, FleetEngine
from tests.conftest import ThreadedServer

pytestmark = pytest.mark.slow  # engine processes killed and stopped

BODY_TOKENS = 400


@pytest.fixture
def engines(tmp_path) -> Iterator[list[FleetEngine]]:
    profile = replace(PROFILES["gpu-only"], gpu_blocks=1024, time_scale=1.0, zero_delay=False)
    with Fleet(tmp_path / "fleet") as fleet:
        started = fleet.start(2, profile)
        try:
            yield started
        finally:
            for engine in started:
                if engine.process is not None and engine.process.poll() is None:
                    os.killpg(engine.pid, signal.SIGCONT)


def _router(serve_asgi: Callable[..., ThreadedServer], engines: list[FleetEngine], **sections) -> str:
    data = {
        "engines": [{**e.fleet_entry(), "kv_events_endpoint": "", "kv_replay_endpoint": ""} for e in engines],
        "policy": {"name": "round_robin"},
        "index": {"enabled": False},
        "events": {"discover": False},
        "costs": {"scrape_interval_s": 0},
        "health": {"interval_s": 0},
        **sections,
    }
    return serve_asgi(build_router_app(load_config(environ={}, overrides=data))).url


def _chat(stream: bool = True) -> dict:
    return {
        "model": "kvroute-sim",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": BODY_TOKENS,
        "stream": stream,
    }


def test_engine_killed_mid_stream_ends_with_an_error_never_a_short_answer(serve_asgi, engines) -> None:
    url = _router(serve_asgi, engines[:1])
    victim = engines[0]
    # The official SDK: it must raise, not return a few chunks as if the answer were complete.
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(**_chat())
    received = 0
    with pytest.raises((openai.APIError, openai.APIConnectionError)):
        for _chunk in stream:
            received += 1
            if received == 3:
                os.killpg(victim.pid, signal.SIGKILL)
    assert 3 <= received < BODY_TOKENS


def test_engine_killed_mid_stream_raw_bytes(serve_asgi, engines) -> None:
    url = _router(serve_asgi, engines[1:])
    events: list[str] = []
    with pytest.raises(httpx.RemoteProtocolError):  # aborted: no chunked terminator
        with httpx.stream("POST", url + "/v1/chat/completions", json=_chat(), timeout=30) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    events.append(line[5:].strip())
                    if len(events) == 3:
                        os.killpg(engines[1].pid, signal.SIGKILL)
    assert "[DONE]" not in events
    error = json.loads(events[-1])["error"]
    assert error["code"] == "upstream_stream_error" and error["type"] == "upstream_error"
    assert "incomplete" in error["message"]


def test_stopped_engine_costs_one_budget_then_fails_over_and_trips_the_breaker(serve_asgi, engines) -> None:
    url = _router(
        serve_asgi,
        engines,
        # read_timeout_s stays 600: the budget is separate. The running engine must send its first
        # token within it too (else 504): 3 s leaves a busy 2-core machine its scheduling delays.
        limits={"first_byte_timeout_s": 3.0},
        health={"interval_s": 0, "breaker_failures": 2, "breaker_open_s": 60.0},
    )
    stopped = engines[0]
    os.killpg(stopped.pid, signal.SIGSTOP)
    try:
        served_by = []
        with httpx.Client(timeout=60) as client:  # far below the 600 s read timeout
            for _ in range(8):
                with client.stream(
                    "POST", url + "/v1/chat/completions", json={**_chat(), "max_tokens": 4}
                ) as resp:
                    assert resp.status_code == 200
                    lines = [line for line in resp.iter_lines() if line.startswith("data:")]
                    assert lines[-1] == "data: [DONE]"
                    served_by.append(resp.headers["x-kvroute-engine"])
        assert set(served_by) == {engines[1].id}
        metrics = httpx.get(url + "/metrics").text
        # Two first-byte timeouts open the breaker; after that round robin skips the engine.
        assert (
            f'kvroute_upstream_errors_total{{engine="{stopped.id}",kind="first_byte_timeout"}} 2.0' in metrics
        )
        ready = httpx.get(url + "/ready").json()
        assert ready["healthy_engines"] == 1
    finally:
        os.killpg(stopped.pid, signal.SIGCONT)


def test_stopped_only_engine_answers_504_after_the_budget(serve_asgi, engines) -> None:
    url = _router(serve_asgi, engines[:1], limits={"first_byte_timeout_s": 1.0})
    os.killpg(engines[0].pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        resp = httpx.post(url + "/v1/chat/completions", json=_chat(), timeout=30)
        assert resp.status_code == 504
        assert resp.json()["error"]["code"] == "upstream_first_byte_timeout"
        assert time.monotonic() - started < 30
    finally:
        os.killpg(engines[0].pid, signal.SIGCONT)
