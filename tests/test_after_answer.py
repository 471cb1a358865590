"""The deferred accounting after an answer (``proxy.defer_accounting``, router/after_answer.py):
the queue alone (order, cap, timer, errors) and the real router on loopback on both paths (the load
released at once, the learning and the observers later: at the next request's upstream send,
before GET /metrics answers, at shutdown)."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

import httpx
import pytest

from router.after_answer import AfterAnswer
from router.app import create_app
from tests.conftest import ThreadedServer
from tests.test_callback_path import _wait_for
from tests.test_fastpath import chat, post, round_robin_config
from tests.test_stream_relay import ScriptedEngine, read_to_last_chunk

#: Long enough that only a drain under test runs the queue (the timer never fires in a test).
NEVER_S = 600.0


def test_the_queue_runs_in_order_at_the_cap_and_logs_a_failing_call(caplog: pytest.LogCaptureFixture) -> None:
    """Fails when the queue grows past its cap (unbounded memory), runs out of order, or stops at
    a failing call (the ones after it lost)."""
    ran: list[int] = []

    def fail() -> None:
        raise ValueError("a bug in the accounting")

    async def scenario() -> None:
        after = AfterAnswer(cap=3, delay_s=NEVER_S)
        after.add(ran.append, 1)
        after.add(fail)
        assert (len(after), ran) == (2, [])
        after.add(ran.append, 2)  # the cap: everything runs now
        assert (len(after), ran) == (0, [1, 2])
        after.add(ran.append, 3)
        after.close()  # shutdown drains
        assert (len(after), ran, after.drained) == (0, [1, 2, 3], 4)

    with caplog.at_level(logging.ERROR, logger="kvroute.after_answer"):
        asyncio.run(scenario())
    assert "accounting after an answer failed" in caplog.text


def test_the_timer_drains_what_nothing_else_did() -> None:
    """Fails when a queued call waits for a drain that never comes (no next request, no scrape)."""

    async def scenario() -> None:
        done = asyncio.Event()
        after = AfterAnswer(delay_s=0.001)
        after.add(done.set)
        await asyncio.wait_for(done.wait(), 10)
        assert len(after) == 0

    asyncio.run(scenario())


def test_drain_soon_runs_the_queue_once_the_caller_has_suspended() -> None:
    """Fails when ``drain_soon`` runs the work at once (on the task path: before the request it
    precedes is written upstream, delaying it) or not at all."""
    ran: list[int] = []

    async def scenario() -> None:
        after = AfterAnswer(delay_s=NEVER_S)
        after.add(ran.append, 1)
        after.drain_soon()
        assert ran == []
        await asyncio.sleep(0)  # one turn of the loop
        assert (ran, len(after)) == ([1], 0)
        after.drain_soon()  # nothing queued: nothing scheduled
        after.close()

    asyncio.run(scenario())


def _deferring_router(
    serve_asgi: Callable[..., ThreadedServer], engine: ScriptedEngine, callback_path: bool
) -> tuple[ThreadedServer, AfterAnswer]:
    config = round_robin_config(
        [engine.url],
        callback_path=callback_path,
        proxy={"callback_path": callback_path, "defer_accounting": True},
    )
    app = create_app(config)
    router = app.state.router
    assert router.after_answer is not None  # the config key turns it on
    server = serve_asgi(app)
    # The same queue with a timer that never fires: only the drains under test run it. Set once
    # the server is up, before any request: these tests are about the deferral itself, so the
    # suite's TEST_KVROUTE_DEFER_ACCOUNTING=0 (tests/conftest.py) does not turn it off here.
    app.after_answer = router.after_answer = AfterAnswer(delay_s=NEVER_S)
    return server, router.after_answer


def _stream(sock: socket.socket, text: str) -> None:
    sock.sendall(post("/v1/chat/completions", chat(stream=True, text=text)))
    data = bytearray()
    read_to_last_chunk(sock, data)
    assert data.startswith(b"HTTP/1.1 200"), bytes(data[:100])


def _requests_counted(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvroute_requests_total{") and 'status="200"' in line
    )


@pytest.mark.parametrize("callback_path", [False, True])
def test_the_load_goes_back_at_once_and_the_learning_by_the_next_request_or_a_scrape(
    serve_asgi: Callable[..., ThreadedServer], callback_path: bool
) -> None:
    """Fails when the load waits with the learning (the engine looks busy to the next decision),
    when the learning is not deferred (the TTFT tally set before any drain), when the next
    request's upstream send does not drain the previous answer's work, or when GET /metrics
    answers without draining (a finished request missing from its counts)."""
    engine = ScriptedEngine()
    try:
        server, after = _deferring_router(serve_asgi, engine, callback_path)
        app = server.server.config.app
        core, tracker = app.state.router.core, app.state.tracker
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            _stream(sock, "q0")
            _wait_for(lambda: core.counters.finished == 1, "the first request finished")
            assert tracker.load("e0") == (0, 0)  # released with the finish, not queued
            assert len(after) == 2 and core.ttft_tally == {}  # first token and finish, waiting
            _stream(sock, "q1")
            _wait_for(lambda: core.counters.finished == 2, "the second request finished")
            # The second request went upstream after the first's answer: its send drained that.
            assert after.drained == 2 and len(after) == 2
            assert core.ttft_tally["e0"].measured_s > 0
        assert _requests_counted(server.url) == 2  # the scrape drained the second's work first
        assert len(after) == 0 and after.drained == 4
    finally:
        engine.stop_listening()


def test_shutdown_runs_what_waits(serve_asgi: Callable[..., ThreadedServer]) -> None:
    """Fails when the router stops with accounting still queued (a last request's metrics, learning
    and log line lost)."""
    engine = ScriptedEngine()
    try:
        server, after = _deferring_router(serve_asgi, engine, False)
        core = server.server.config.app.state.router.core
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            _stream(sock, "q0")
        _wait_for(lambda: core.counters.finished == 1, "the request finished")
        assert len(after) == 2
        server.stop()
        assert len(after) == 0 and "e0" in core.ttft_tally
    finally:
        engine.stop_listening()
