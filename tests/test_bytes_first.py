"""The client's bytes first, the book-keeping after (issue 26, round dp21), on real loopback sockets
and both paths (the task path, and the callback path: proxy.callback_path), streams and not.

The router's accounting of an answer (core.on_first_token / on_finished, the route observers,
metrics, the log line) runs right after the write it is about, in the same step of the event loop.
The probe: a route observer that, for one request, waits in the router's loop (at most ``WAIT_S``)
until the client - this test's thread, not the router's - has the bytes the hook is about (the
first SSE event at ``on_first_byte``, the whole answer at ``on_finished``), and records whether they
came. Bytes first, the kernel has them before the observer runs; accounting first, the observer
blocks the loop before the write, waits in vain and records False."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgspec
import pytest

from router.app import create_app
from router.routing import RouteContext
from tests.conftest import ThreadedServer
from tests.test_callback_path import _count, _wait_for
from tests.test_fastpath import chat, round_robin_config
from tests.test_stream_relay import DONE, ScriptedEngine, chunked_body

#: How long the probe holds the router's loop waiting for the client's bytes.
WAIT_S = 10.0

PATHS = pytest.mark.parametrize("callback_path", [False, True], ids=["task", "callback"])


class Probe:
    """A route observer: for the request ``request_id``, ``on_first_byte`` waits until the client
    has the first event and ``on_finished`` until it has the whole answer (``had``: whether it did
    within ``WAIT_S``); ``fail`` (a hook's name): that hook raises for the request instead.
    ``finished`` (id, status) and ``at_routed`` (the requests finished when a request was routed,
    and the engine's load then) for every request (one engine: e0)."""

    def __init__(self, tracker: Callable[[], Any]) -> None:
        self.request_id = ""
        self.first_event = threading.Event()
        self.whole = threading.Event()
        self.had: dict[str, bool] = {}
        self.fail = ""
        self.finished: list[tuple[str, int]] = []
        self.at_routed: dict[str, tuple[list[str], int]] = {}
        self._tracker = tracker

    def on_routed(self, ctx: RouteContext) -> None:
        load = self._tracker().load("e0")[0]
        self.at_routed[ctx.request_id] = ([request_id for request_id, _ in self.finished], load)

    def on_first_byte(self, ctx: RouteContext) -> None:
        if ctx.request_id == self.request_id:
            if self.fail == "on_first_byte":
                raise RuntimeError("the probe fails on_first_byte")
            self.had["on_first_byte"] = self.first_event.wait(WAIT_S)

    def on_finished(self, ctx: RouteContext) -> None:
        if ctx.request_id == self.request_id:
            if self.fail == "on_finished":
                raise RuntimeError("the probe fails on_finished")
            self.had["on_finished"] = self.whole.wait(WAIT_S)
        self.finished.append((ctx.request_id, ctx.http_status))


def _router(
    serve_asgi: Callable[..., ThreadedServer], url: str, callback_path: bool, defer: bool | None = None
) -> tuple[ThreadedServer, Probe]:
    """``defer``: proxy.defer_accounting on or off (None: the default)."""
    config = round_robin_config([url], callback_path=callback_path)
    if defer is not None:
        proxy = msgspec.structs.replace(config.proxy, defer_accounting=defer)
        config = msgspec.structs.replace(config, proxy=proxy)
    app = create_app(config, observers=[probe := Probe(lambda: app.state.tracker)])
    return serve_asgi(app), probe


@pytest.fixture
def engine() -> Iterator[ScriptedEngine]:
    scripted = ScriptedEngine()
    try:
        yield scripted
    finally:
        scripted.stop_listening()


def _ask(sock: socket.socket, body: bytes, request_id: str) -> None:
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"x-request-id: %s\r\ncontent-length: %d\r\n\r\n%s" % (request_id.encode(), len(body), body)
    )


def _read(sock: socket.socket, probe: Probe | None = None) -> tuple[int, dict[str, str], bytes]:
    """One answer off ``sock``: status, headers, body (a chunked one unframed); ``probe`` told as
    its bytes come (the first SSE event, the whole answer)."""
    sock.settimeout(3 * WAIT_S)
    data = bytearray()
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        assert more, f"the connection closed before an answer's head: {bytes(data)!r}"
        data += more
    start = data.index(b"\r\n\r\n") + 4
    lines = data[: start - 4].decode("latin-1").split("\r\n")
    headers = {name.lower(): value for name, value in (line.split(": ", 1) for line in lines[1:])}
    chunked = headers.get("transfer-encoding") == "chunked"
    size = 0 if chunked else int(headers["content-length"])
    while True:
        if probe is not None and b"data:" in data[start:]:
            probe.first_event.set()
        if data.endswith(b"0\r\n\r\n") if chunked else len(data) - start >= size:
            break
        more = sock.recv(65536)
        assert more, f"the connection closed before the end of the answer: {bytes(data)!r}"
        data += more
    if probe is not None:
        probe.whole.set()
    body = chunked_body(data) if chunked else bytes(data[start : start + size])
    return int(lines[0].split()[1]), headers, body


def _warm(sock: socket.socket, body: bytes, probe: Probe) -> None:
    """A request that leaves an idle pooled connection to the engine (the callback path sends on
    one), accounted before the probed one goes."""
    _ask(sock, body, "warm")
    status, _, _ = _read(sock)
    assert status == 200
    _wait_for(lambda: ("warm", 200) in probe.finished, "the warm-up request accounted")


def _check_path(server: ThreadedServer, task_starts: list[object]) -> None:
    """The probed request took the path under test: callbacks only on the callback path (the
    router's: TEST_KVROUTE_CALLBACK_PATH=1 puts every test router on it), a task on the other."""
    if server.server.config.app.proxy_now is not None:
        assert task_starts == []
    else:
        assert len(task_starts) == 1


def _stream_events(body: bytes) -> list[bytes]:
    return [part + b"\n\n" for part in body.split(b"\n\n") if part]


@PATHS
def test_a_whole_answer_reaches_the_client_before_it_is_accounted(
    serve_asgi: Callable[..., ThreadedServer], upstreams: Any, task_starts: list[object], callback_path: bool
) -> None:
    """Catches: a non-stream answer's finish (core.on_finished, observers, metrics, the log line)
    run before the answer is written (``_BodyAnswer.send`` / ``answer_now``, the callback path's
    ``client.answer``)."""
    ((_, url),) = upstreams(1)
    server, probe = _router(serve_asgi, url, callback_path)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        _warm(sock, chat(), probe)
        task_starts.clear()
        probe.request_id = "probe"
        _ask(sock, chat(text="probed"), "probe")
        status, headers, body = _read(sock, probe)
    assert status == 200 and headers["x-request-id"] == "probe" and b"chat.completion" in body
    _wait_for(lambda: "on_finished" in probe.had, "the probe's finish")
    assert probe.had == {"on_finished": True}
    _check_path(server, task_starts)


@PATHS
@pytest.mark.parametrize("apart", [True, False], ids=["events-apart", "one-read"])
def test_a_streams_first_event_reaches_the_client_before_it_is_accounted(
    serve_asgi: Callable[..., ThreadedServer],
    engine: ScriptedEngine,
    task_starts: list[object],
    callback_path: bool,
    apart: bool,
) -> None:
    """``apart``: the engine writes each event apart (the first in a read of its own); else its
    whole stream in one write (which the callback path sends in one write too:
    ``_CallbackStream.send_whole``). Catches: the first event's accounting (core.on_first_token:
    the TTFT learning; the first-byte observers) run before the write that carries the event
    (``_forward`` / ``StreamRelay.feed`` on either path), and the finish before the last bytes."""
    if apart:
        engine.piece_bytes, engine.gap_s = 1 << 16, 0.02
    server, probe = _router(serve_asgi, engine.url, callback_path)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        _warm(sock, chat(stream=True), probe)
        task_starts.clear()
        probe.request_id = "probe"
        _ask(sock, chat(stream=True, text="probed"), "probe")
        status, _, body = _read(sock, probe)
    assert status == 200 and _stream_events(body) == [*engine.events, DONE]
    _wait_for(lambda: "on_finished" in probe.had, "the probe's finish")
    assert probe.had == {"on_first_byte": True, "on_finished": True}
    _check_path(server, task_starts)


#: The core's accounting made to raise: its learning halves, or its load halves. The wholes the
#: router calls without proxy.defer_accounting (``on_first_token``, ``on_finished``) run them, the
#: deferred path calls them one by one, so either fails on both paths.
CORE_FAULTS = {
    "learning": ("tally_first_token", "learn_finished"),
    "load": ("release_prefill", "release_finished"),
}


@PATHS
@pytest.mark.parametrize("defer", [False, True], ids=["now", "deferred"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("failing", ["core-learning", "core-load", "observer"])
def test_an_accounting_error_after_the_answer_leaves_it_as_it_went(
    serve_asgi: Callable[..., ThreadedServer],
    upstreams: Any,
    engine: ScriptedEngine,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    callback_path: bool,
    stream: bool,
    defer: bool,
    failing: str,
) -> None:
    """The core's first-token and finish accounting (its learning or its load halves), or a route
    observer's hooks, raise for the probed request once its bytes are out; with the accounting run
    at once or deferred (proxy.defer_accounting). Catches: the answer turned into a 500 or cut off
    (the connection closed), a next request on the connection refused, the error not logged with
    the request's id (the deferred path's queue logging it without), the load held when only the
    learning failed."""
    url = engine.url if stream else upstreams(1)[0][1]
    server, probe = _router(serve_asgi, url, callback_path, defer)
    router = server.server.config.app.state.router
    core = router.core
    caplog.set_level(logging.WARNING)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        _warm(sock, chat(stream=stream), probe)
        if failing.startswith("core-"):

            def failed(*args: Any) -> None:
                raise RuntimeError("the core fails")

            for name in CORE_FAULTS[failing.removeprefix("core-")]:
                monkeypatch.setattr(core, name, failed)
            expected = "request probe: the accounting after the answer failed"
        else:
            probe.fail = "on_first_byte" if stream else "on_finished"
            expected = f"failed in {probe.fail} (request probe)"
            probe.request_id = "probe"  # (not for the core's faults: its hooks that run would wait)
        _ask(sock, chat(stream=stream, text="probed"), "probe")
        # (read with the probe told: its hook that does not fail waits for the client's bytes)
        status, headers, body = _read(sock, probe)
        assert status == 200 and headers["x-request-id"] == "probe"
        if stream:
            assert _stream_events(body) == [*engine.events, DONE]
        else:
            assert body.startswith(b"{") and b"chat.completion" in body
        # (the accounting runs after the write: the client may have the answer before it failed)
        _wait_for(lambda: any(expected in r.getMessage() for r in caplog.records), expected)
        if failing != "core-load":
            _wait_for(lambda: router.tracker.load("e0")[0] == 0, "the probed request's load released")
        monkeypatch.undo()
        probe.fail = ""
        _ask(sock, chat(stream=stream, text="after"), "after")  # the connection was kept
        assert _read(sock)[0] == 200
    messages = [record.getMessage() for record in caplog.records]
    assert not any("internal router error" in m or "unexpected error" in m for m in messages), messages


@PATHS
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_the_next_request_and_a_scrape_see_the_answer_accounted(
    serve_asgi: Callable[..., ThreadedServer],
    upstreams: Any,
    engine: ScriptedEngine,
    callback_path: bool,
    stream: bool,
) -> None:
    """The accounting follows the write in the same loop step: a /metrics scrape sent once the
    client has the answer, and the client's next request on the connection, find it finished.
    Catches: the accounting moved to a later loop step (call_soon, a task, an await after the
    write), where a scrape or the next request could come first."""
    url = engine.url if stream else upstreams(1)[0][1]
    server, probe = _router(serve_asgi, url, callback_path)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        _warm(sock, chat(stream=stream), probe)
        _ask(sock, chat(stream=stream, text="first"), "first")
        assert _read(sock)[0] == 200
        assert _count(httpx.get(server.url + "/metrics").text, "200") == 2
        _ask(sock, chat(stream=stream, text="next"), "next")
        status, _, body = _read(sock)
    assert status == 200 and (b"data: [DONE]" in body) == stream
    finished, load = probe.at_routed["next"]
    assert finished == ["warm", "first"] and load == 1  # the next request's own reservation only
