"""limits.client_write_timeout_s through the real router on loopback, on both paths (the task path
and proxy.callback_path): a client that stops reading its answer is cut once it has taken none of
the bytes waiting for it for the timeout - its connection and the engine's aborted, the request
accounted once (499 with the reason, or its complete answer's 200), one warning line, the
``kvroute_client_write_timeouts_total`` counter, the engine's breaker not charged, the load given
back - while a client that reads slowly but steadily gets its whole answer, and 0 keeps today's
unbounded wait."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from router.config import ConfigError, load_config
from router.routing import RouteContext
from tests import test_stream_relay
from tests.conftest import ThreadedServer
from tests.test_callback_path import RawEngine, Recorder, _count, _wait_for, completion_answer
from tests.test_fastpath import chat, post
from tests.test_stream_relay import (
    DONE,
    USAGE,
    ScriptedEngine,
    _router,
    chunked_body,
    read_to_last_chunk,
    token_events,
)

engine = test_stream_relay.engine  # the scripted engine fixture, shared
TIMEOUT_S = 0.4
#: The steady reader's timeout: long enough that a test thread starved on a busy machine is not
#: taken for a stalled client, short enough that its ~5 s of reading spans several timeouts.
STEADY_TIMEOUT_S = 1.0
PATHS = pytest.mark.parametrize("callback_path", [False, True], ids=["task", "callback"])


class ErrorRecorder(Recorder):
    """``Recorder`` with each finished request's error."""

    def on_finished(self, ctx: RouteContext) -> None:
        super().on_finished(ctx)
        self.finished[-1]["error"] = ctx.error


class WholeAnswerEngine(RawEngine):
    """Answers every request with one non-stream JSON completion of about ``content_bytes``,
    content-length framed, in one write; keeps its connections (keep-alive)."""

    def __init__(self, content_bytes: int) -> None:
        self.answer = completion_answer("y" * content_bytes, usage=USAGE)
        self.closed = threading.Event()  # the router closed a connection
        super().__init__()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while True:
                read = self.read_request(conn, data)
                if read is None:
                    self.closed.set()
                    return
                data = read[1]
                conn.sendall(self.answer)


def _streaming_router(
    serve_asgi: Callable[..., ThreadedServer],
    engine: ScriptedEngine,
    callback_path: bool,
    events: int,
    timeout_s: float,
) -> tuple[ErrorRecorder, ThreadedServer]:
    """A router under limits.client_write_timeout_s = ``timeout_s`` before ``engine``, which
    streams ``events`` events of 16 KiB in 1 MiB writes; and the recorder of its finished requests."""
    engine.events = token_events(events, "x" * (16384 - 80))
    engine.piece_bytes = 1 << 20
    recorder = ErrorRecorder()
    limits = {"client_write_timeout_s": timeout_s}
    return recorder, _router(serve_asgi, engine, recorder, callback_path, limits=limits)


def _client(server: ThreadedServer, request: bytes) -> socket.socket:
    """A connection with a small receive window (set before connecting) that sent ``request``."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(request)
    sock.settimeout(30)
    return sock


def _read_head(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(4096)
        assert more, data
        data += more
    return data


def _read_to_close(sock: socket.socket) -> bytes:
    """Everything up to the router's close or reset of the connection."""
    data = bytearray()
    try:
        while more := sock.recv(1 << 20):
            data += more
    except ConnectionResetError:
        pass
    return bytes(data)


def _timeouts(metrics: str) -> dict[str, float]:
    return {
        line.split('engine="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("kvroute_client_write_timeouts_total{")
    }


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "client write timeout" in r.getMessage()]


@PATHS
def test_a_stream_to_a_client_that_stops_reading_is_cut_after_the_timeout(
    serve_asgi: Callable[..., ThreadedServer],
    engine: ScriptedEngine,
    callback_path: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 64 MiB stream to a client that reads its head and then nothing: the router stops reading
    the engine (flow control), and after limits.client_write_timeout_s without progress it aborts
    both connections - the engine sees its connection closed mid-answer, which is what stops the
    request in vLLM. Accounted once: 499 with the reason in its one warning line, the counter at
    1, no breaker failure, the load back to 0. Catches: a client that never reads holding the
    engine's request forever; the cut counted as the engine's failure or as a plain hang-up."""
    caplog.set_level(logging.WARNING)
    recorder, server = _streaming_router(serve_asgi, engine, callback_path, 4096, TIMEOUT_S)
    sock = _client(server, post("/v1/chat/completions", chat(stream=True)))
    try:
        _read_head(sock)
        stopped_reading = time.monotonic()
        assert engine.cut_off.wait(30), "the engine's connection was left open"
        waited_s = time.monotonic() - stopped_reading
        rest = _read_to_close(sock)
    finally:
        sock.close()
    assert waited_s >= TIMEOUT_S, f"cut after {waited_s:.2f} s"
    assert not rest.endswith(b"0\r\n\r\n") and engine.finished == 0
    _wait_for(lambda: len(recorder.finished) == 1, "the finished stream")
    (record,) = recorder.finished
    assert record["status"] == 499 and record["error"].startswith("client write timeout:")
    (line,) = _warnings(caplog)
    assert record["id"] in line and "engine e0" in line and "(status 499)" in line
    assert "bytes waiting for it" in line and "upstream request cancelled" in line
    app = server.server.config.app
    metrics = httpx.get(server.url + "/metrics").text
    assert _timeouts(metrics) == {"e0": 1.0}
    assert _count(metrics, "499") == 1
    assert app.state.tracker.engines["e0"].breaker_failures == 0
    # Given back once: nothing in flight or queued, nothing left running upstream.
    _wait_for(lambda: app.state.tracker.load("e0") == (0, 0), "the load given back")
    assert not app.state.router.client._running
    assert 'kvroute_in_flight{engine="e0"} 0.0' in httpx.get(server.url + "/metrics").text


@PATHS
def test_a_whole_answer_to_a_client_that_stops_reading_is_cut_after_the_timeout(
    serve_asgi: Callable[..., ThreadedServer], callback_path: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A 16 MiB non-stream answer, more than the kernel's buffers on both sides take, to a client
    that reads nothing: the router's part is over (the engine answered in full: 200, its
    connection back in the pool, its load given back) but the bytes wait in the client's
    transport; after the timeout the connection is aborted, with one warning line naming the
    request and the counter at 1. Catches: a non-reading client holding the answer in the
    router's memory forever."""
    caplog.set_level(logging.WARNING)
    big = WholeAnswerEngine(16 << 20)
    try:
        recorder = ErrorRecorder()
        server = _router(
            serve_asgi, big, recorder, callback_path, limits={"client_write_timeout_s": TIMEOUT_S}
        )
        sock = _client(server, post("/v1/chat/completions", chat()))
        try:
            _wait_for(lambda: len(recorder.finished) == 1, "the answered request")
            assert recorder.finished[0]["status"] == 200
            _wait_for(lambda: _timeouts(httpx.get(server.url + "/metrics").text) == {"e0": 1.0}, "the cut")
            received = _read_to_close(sock)
        finally:
            sock.close()
        assert len(received) < len(big.answer), "the whole answer went out: the test proves nothing"
        (line,) = _warnings(caplog)
        assert recorder.finished[0]["id"] in line and "engine e0" in line and "connection aborted" in line
        app = server.server.config.app
        assert app.state.tracker.load("e0")[0] == 0 and app.state.tracker.engines["e0"].breaker_failures == 0
        assert len(recorder.finished) == 1 and _count(httpx.get(server.url + "/metrics").text, "200") == 1
        assert not big.closed.is_set()  # the engine's connection did its work: kept in the pool
    finally:
        big.stop_listening()


@PATHS
def test_a_client_reading_slowly_but_steadily_gets_the_whole_stream(
    serve_asgi: Callable[..., ThreadedServer],
    engine: ScriptedEngine,
    callback_path: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 6 MiB stream read 64 KiB every 50 ms (about 5 s, five timeouts; the router's writing
    to it is seen paused): progress restarts the clock, so the client is never cut and gets every
    byte; nothing is counted. Catches: a cut measured from the pause rather than from the last
    progress, or progress looked for in the transport's buffer alone (the kernel's megabytes
    drain first: the transport's buffer stands still for seconds)."""
    caplog.set_level(logging.WARNING)
    recorder, server = _streaming_router(serve_asgi, engine, callback_path, 384, STEADY_TIMEOUT_S)
    sock = _client(server, post("/v1/chat/completions", chat(stream=True)))
    data = bytearray()
    paused_seen = 0
    try:
        while not data.endswith(b"0\r\n\r\n"):
            more = sock.recv(65536)
            assert more, f"the connection closed after {len(data)} bytes"
            data += more
            paused_seen += _writing_paused(server)
            time.sleep(0.05)
    finally:
        sock.close()
    assert paused_seen >= 10, "the router's writing was never paused: the test proves nothing"
    assert chunked_body(bytes(data)) == b"".join([*engine.events, DONE])
    _wait_for(lambda: len(recorder.finished) == 1, "the finished stream")
    assert recorder.finished[0]["status"] == 200
    assert _warnings(caplog) == []
    assert _timeouts(httpx.get(server.url + "/metrics").text) == {}


def _writing_paused(server: ThreadedServer) -> bool:
    """Whether the router's writing to a client is paused (read on its event loop)."""
    loop = server.server.config.app.state.router.client._loop
    assert loop is not None

    async def paused() -> bool:
        return any(p.flow.write_paused for p in server.server.server_state.connections)

    return asyncio.run_coroutine_threadsafe(paused(), loop).result(10)


@PATHS
def test_zero_keeps_a_non_reading_client_waiting(
    serve_asgi: Callable[..., ThreadedServer], engine: ScriptedEngine, callback_path: bool
) -> None:
    """limits.client_write_timeout_s = 0: no bound, as before - a client that stops reading for
    several times the test timeout is not cut, and gets the whole answer when it reads on."""
    recorder, server = _streaming_router(serve_asgi, engine, callback_path, 4096, 0)
    sock = _client(server, post("/v1/chat/completions", chat(stream=True)))
    try:
        data = bytearray(_read_head(sock))
        # Stalled: the engine sent no more for 5 x the test timeout (so the router's writing is paused).
        last_sent, still_since = -1, time.monotonic()
        while time.monotonic() - still_since < 5 * TIMEOUT_S:
            if engine.sent_bytes != last_sent:
                last_sent, still_since = engine.sent_bytes, time.monotonic()
            time.sleep(0.02)
        assert engine.finished == 0 and not engine.cut_off.is_set()
        read_to_last_chunk(sock, data)
    finally:
        sock.close()
    assert chunked_body(bytes(data)) == b"".join([*engine.events, DONE])
    _wait_for(lambda: len(recorder.finished) == 1, "the finished stream")
    assert recorder.finished[0]["status"] == 200
    assert _timeouts(httpx.get(server.url + "/metrics").text) == {}


@pytest.mark.parametrize("value", ["-1", "nan", "soon"])
def test_a_bad_client_write_timeout_is_a_clear_error(value: str) -> None:
    environ = {"KVROUTE_LIMITS_CLIENT_WRITE_TIMEOUT_S": value}
    with pytest.raises(ConfigError, match="client_write_timeout_s"):
        load_config(environ=environ, overrides={"engines": [{"id": "e0", "url": "http://127.0.0.1:1"}]})


def test_the_client_write_timeout_is_read_from_the_environment() -> None:
    environ = {"KVROUTE_LIMITS_CLIENT_WRITE_TIMEOUT_S": "2.5"}
    config = load_config(environ=environ, overrides={"engines": [{"id": "e0", "url": "http://127.0.0.1:1"}]})
    assert config.limits.client_write_timeout_s == 2.5
    default = load_config(environ={}, overrides={"engines": [{"id": "e0", "url": "http://127.0.0.1:1"}]})
    assert default.limits.client_write_timeout_s == 60.0
