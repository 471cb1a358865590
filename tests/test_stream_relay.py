"""Streams through the real router on loopback, on both paths: the task path (a task steps
``_StreamAnswer.send`` per piece) and the callback path (proxy.callback_path: once the first event is
in, ``_CallbackStream`` relays every read of the engine's answer from the upstream connection's
callbacks). One raw HTTP/1.1 engine, scripted per test, stands behind the router: how its SSE bytes
are cut into writes, how the answer ends (complete, or the connection reset mid-stream), and what it
saw (bytes sent, its connection closed by the router)."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from router.app import create_app
from router.fastpath import ProxyExchange
from router.routing import _StreamAnswer, _UsageChunkStripper
from tests.conftest import ThreadedServer
from tests.test_callback_path import RawEngine, Recorder, _count, _wait_for
from tests.test_fastpath import chat, post, read_answers, round_robin_config

USAGE = {"prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23}


def event(doc: Any) -> bytes:
    return b"data: %s\n\n" % json.dumps(doc).encode()


def token_events(count: int, text: str = "tok") -> list[bytes]:
    choice = {"index": 0, "delta": {"content": text}}
    return [event({"id": "s", "object": "chat.completion.chunk", "choices": [choice]}) for _ in range(count)]


USAGE_EVENT = event({"id": "s", "object": "chat.completion.chunk", "choices": [], "usage": USAGE})
DONE = b"data: [DONE]\n\n"


class ScriptedEngine(RawEngine):
    """A raw HTTP/1.1 engine on loopback answering each request with a chunked SSE stream of
    ``events`` (the usage event before [DONE] when the request asks for usage), written
    ``piece_bytes`` at a time (0: the whole answer, head to terminator, in one write) with
    ``gap_s`` between writes; ``die_after`` events, the connection is reset instead of ending.
    Records the request bodies, the bytes it wrote, whether it finished an answer and whether the
    router closed its connection mid-answer."""

    def __init__(self) -> None:
        self.events: list[bytes] = token_events(3)
        self.piece_bytes = 0
        self.gap_s = 0.0
        self.die_after: int | None = None
        self.stall_s = 0.0  # after the head, before the first event
        self.stalled = 0
        self.bodies: list[bytes] = []
        self.sent_bytes = 0
        self.finished = 0
        self.cut_off = threading.Event()  # the router closed the connection mid-answer
        super().__init__()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            for body in self.each_request(conn):
                self.bodies.append(body)
                if not self._answer(conn, json.loads(body)):
                    return

    def _answer(self, conn: socket.socket, request: dict[str, Any]) -> bool:
        events = list(self.events)
        if (request.get("stream_options") or {}).get("include_usage"):
            events.append(USAGE_EVENT)
        events.append(DONE)
        die_after = self.die_after
        if die_after is not None:
            events = events[:die_after]
        frames = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"]
        frames += [b"%x\r\n%s\r\n" % (len(e), e) for e in events]
        if die_after is None:
            frames.append(b"0\r\n\r\n")
        try:
            if self.stall_s:
                conn.sendall(frames.pop(0))
                self.stalled += 1
                self._stop.wait(self.stall_s)
            if not self.piece_bytes:
                wire = b"".join(frames)
                conn.sendall(wire)
                self.sent_bytes += len(wire)
            else:
                for frame in frames:
                    for i in range(0, len(frame), self.piece_bytes):
                        conn.sendall(frame[i : i + self.piece_bytes])
                        self.sent_bytes += min(self.piece_bytes, len(frame) - i)
                        if self.gap_s:
                            time.sleep(self.gap_s)
        except OSError:
            self.cut_off.set()
            return False
        if die_after is not None:
            # A reset, not a clean close: the engine process died.
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return False
        self.finished += 1
        return True


def read_to_last_chunk(sock: socket.socket, data: bytearray) -> None:
    """Read a chunked answer off ``sock`` into ``data`` up to its last (empty) chunk."""
    while not data.endswith(b"0\r\n\r\n"):
        more = sock.recv(1 << 20)
        assert more, "the connection closed before the end of the answer"
        data += more


def chunked_body(data: bytes | bytearray) -> bytes:
    """The body of a chunked HTTP answer (``data``: its head and every chunk up to the last)."""
    body = bytearray()
    view, at = memoryview(data), data.index(b"\r\n\r\n") + 4
    while True:
        end = data.index(b"\r\n", at)
        size = int(data[at:end], 16)
        body += view[end + 2 : end + 2 + size]
        at = end + 2 + size + 2
        if size == 0:
            return bytes(body)


@pytest.fixture
def engine() -> Iterator[ScriptedEngine]:
    scripted = ScriptedEngine()
    try:
        yield scripted
    finally:
        scripted.stop_listening()


@pytest.fixture
def relay_generators(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The request ids of every stream a task relayed (``_StreamAnswer.send``, the task path)."""
    started: list[str] = []
    original = _StreamAnswer.send

    def counting(self: _StreamAnswer, send: Any, watcher: Any) -> Any:
        started.append(self.relay.ctx.request_id)
        return original(self, send, watcher)

    monkeypatch.setattr(_StreamAnswer, "send", counting)
    return started


def _router(
    serve_asgi: Callable[..., ThreadedServer],
    engine: ScriptedEngine | list[ScriptedEngine],
    recorder: Recorder,
    callback_path: bool,
    **sections: Any,
) -> ThreadedServer:
    engines = engine if isinstance(engine, list) else [engine]
    config = round_robin_config([e.url for e in engines], callback_path=callback_path, **sections)
    return serve_asgi(create_app(config, observers=[recorder]))


def _events(body: bytes) -> list[bytes]:
    return [part for part in body.split(b"\n\n") if part]


def _check_relay(server: ThreadedServer, relay_generators: list[str], streams: int) -> None:
    """The path each stream took: a task's generator on the task path, never on the callback path
    (the router's: TEST_KVROUTE_CALLBACK_PATH=1 puts every test router on it)."""
    callback_path = server.server.config.app.proxy_now is not None
    assert len(relay_generators) == (0 if callback_path else streams)


PATHS = pytest.mark.parametrize("callback_path", [False, True], ids=["task", "callback"])


@PATHS
def test_a_whole_stream_in_one_upstream_read(
    serve_asgi: Callable[..., ThreadedServer],
    engine: ScriptedEngine,
    relay_generators: list[str],
    callback_path: bool,
) -> None:
    """Head, every event, the usage event and the terminator in one write: the relay starts with the
    answer already complete. Catches: the end of an answer that came with its first event lost (a
    relay waiting for a read that never comes), events relayed twice, the usage not read."""
    engine.events = token_events(5)
    recorder = Recorder()
    server = _router(serve_asgi, engine, recorder, callback_path)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        for i in range(2):  # the second on a reused client connection and pooled upstream one
            sock.sendall(post("/v1/chat/completions", chat(stream=True, text=f"q{i}")))
            (answer,) = read_answers(sock, 1)
            assert answer.status_code == 200 and answer.headers["x-kvroute-engine"] == "e0"
            assert _events(answer.content) == [e.strip() for e in [*engine.events, DONE]]
    _wait_for(lambda: len(recorder.finished) == 2, "2 finished streams")
    assert [r["status"] for r in recorder.finished] == [200, 200]
    assert all(r["usage"] == USAGE for r in recorder.finished)
    _check_relay(server, relay_generators, 2)
    assert _count(httpx.get(server.url + "/metrics").text, "200") == 2
    tracker = server.server.config.app.state.tracker
    assert tracker.load("e0")[0] == 0


@pytest.mark.parametrize("piece_bytes", [0, 40], ids=["whole", "in-pieces"])
def test_a_whole_stream_goes_out_on_the_task_path_without_asgi_messages(
    serve_asgi: Callable[..., ThreadedServer],
    engine: ScriptedEngine,
    monkeypatch: pytest.MonkeyPatch,
    piece_bytes: int,
) -> None:
    """The task path (round dp23): a stream complete when its relay begins is written through the
    exchange's ``stream_now`` (one write, no ``send`` message or await), one that comes in pieces
    through ``send`` as before; either way the client gets every event, the usage event stripped,
    and the stream is accounted. Catches the whole-stream shortcut not taken on kvroute's own
    exchange (e.g. ``send`` wrapped so its exchange is not found), or taken for a stream still
    coming (its rest lost)."""
    sends: list[str] = []
    original = ProxyExchange.send

    async def counting(self: ProxyExchange, message: dict[str, Any]) -> None:
        sends.append(message["type"])
        await original(self, message)

    monkeypatch.setattr(ProxyExchange, "send", counting)
    engine.events = token_events(4)
    engine.piece_bytes, engine.gap_s = piece_bytes, 0.002
    recorder = Recorder()
    server = _router(serve_asgi, engine, recorder, callback_path=False)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(post("/v1/chat/completions", chat(stream=True)))
        (answer,) = read_answers(sock, 1)
    assert answer.status_code == 200
    assert answer.content == b"".join([*engine.events, DONE])
    _wait_for(lambda: len(recorder.finished) == 1, "the finished stream")
    assert recorder.finished[0]["status"] == 200 and recorder.finished[0]["usage"] == USAGE
    if piece_bytes and server.server.config.app.proxy_now is None:
        assert sends[0] == "http.response.start" and len(sends) >= 3
    else:  # (TEST_KVROUTE_CALLBACK_PATH=1 puts the router on the callback path: no send at all)
        assert sends == []


@PATHS
@pytest.mark.parametrize("client_usage", [False, True], ids=["stripped", "asked"])
def test_the_usage_event_is_stripped_or_passed_on_across_reads(
    serve_asgi: Callable[..., ThreadedServer],
    engine: ScriptedEngine,
    relay_generators: list[str],
    callback_path: bool,
    client_usage: bool,
) -> None:
    """The engine's bytes in 40-byte writes, events cut anywhere: the router's own usage event is
    taken out when the client did not ask for usage (and kept when it did), every other byte passes
    unchanged, and the usage is read either way. Catches: a half event relayed as the usage event's
    start, the stripper's held-back bytes lost at the end, the usage not read on a relay."""
    engine.events = token_events(4)
    engine.piece_bytes, engine.gap_s = 40, 0.002
    recorder = Recorder()
    server = _router(serve_asgi, engine, recorder, callback_path)
    body = json.loads(chat(stream=True))
    if client_usage:
        body["stream_options"] = {"include_usage": True}
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(post("/v1/chat/completions", json.dumps(body).encode()))
        (answer,) = read_answers(sock, 1)
    assert answer.status_code == 200
    expected = [*engine.events, *([USAGE_EVENT] if client_usage else []), DONE]
    assert answer.content == b"".join(expected)
    assert json.loads(engine.bodies[-1])["stream_options"] == {"include_usage": True}
    _wait_for(lambda: len(recorder.finished) == 1, "the finished stream")
    assert recorder.finished[0]["status"] == 200 and recorder.finished[0]["usage"] == USAGE
    _check_relay(server, relay_generators, 1)


@PATHS
def test_an_engine_dying_mid_stream_ends_with_the_error_event_and_an_abort(
    serve_asgi: Callable[..., ThreadedServer],
    engine: ScriptedEngine,
    relay_generators: list[str],
    callback_path: bool,
) -> None:
    """The engine resets its connection after 3 of 8 events: the client gets those 3, the
    OpenAI-shaped error event, then a connection closed without the chunked terminator (never a
    short answer that looks complete); 502 "stream broke off", one upstream error and one breaker
    failure counted, the load given back - the same on both paths."""
    engine.events = token_events(8)
    engine.piece_bytes, engine.gap_s, engine.die_after = 10_000, 0.01, 3
    recorder = Recorder()
    server = _router(serve_asgi, engine, recorder, callback_path)
    lines: list[str] = []
    with pytest.raises(httpx.RemoteProtocolError):  # aborted: no chunked terminator
        body = json.loads(chat(stream=True))
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line:
                    lines.append(line)
    assert len(lines) == 4 and "[DONE]" not in lines[-1]
    error = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert error["code"] == "upstream_stream_error" and "incomplete" in error["message"]
    _wait_for(lambda: len(recorder.finished) == 1, "the finished stream")
    assert recorder.finished[0]["status"] == 502
    _check_relay(server, relay_generators, 1)
    app = server.server.config.app
    state = app.state.tracker.engines["e0"]
    assert state.breaker_failures == 1
    metrics = httpx.get(server.url + "/metrics").text
    assert 'kvroute_upstream_errors_total{engine="e0",kind="error"} 1.0' in metrics
    assert _count(metrics, "502") == 1
    assert app.state.tracker.load("e0")[0] == 0


@PATHS
def test_a_client_hanging_up_mid_stream_closes_the_engines_connection(
    serve_asgi: Callable[..., ThreadedServer],
    engine: ScriptedEngine,
    relay_generators: list[str],
    callback_path: bool,
) -> None:
    """A 10 s stream (an event every 20 ms); the client reads two events and hangs up: the router
    closes the engine's connection (that is what cancels the request in vLLM) and accounts the
    request as client gone (499) once, its load given back."""
    engine.events = token_events(500)
    engine.piece_bytes, engine.gap_s = 10_000, 0.02
    recorder = Recorder()
    server = _router(serve_asgi, engine, recorder, callback_path)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(post("/v1/chat/completions", chat(stream=True)))
        sock.settimeout(30)
        seen = b""
        while seen.count(b"data:") < 2:
            more = sock.recv(65536)
            assert more, seen
            seen += more
    assert engine.cut_off.wait(10), "the engine's connection was left open"
    _wait_for(lambda: len(recorder.finished) == 1, "the finished stream")
    assert recorder.finished[0]["status"] == 499
    _check_relay(server, relay_generators, 1)
    metrics = httpx.get(server.url + "/metrics").text
    assert _count(metrics, "499") == 1
    assert server.server.config.app.state.tracker.load("e0")[0] == 0
    assert engine.finished == 0


@PATHS
def test_a_stream_without_its_first_event_in_the_budget_fails_over(
    serve_asgi: Callable[..., ThreadedServer], task_starts: list[object], callback_path: bool
) -> None:
    """Warm streams on the callback path are sent and relayed without a task; one whose engine sends
    its head but no event within the first-byte budget goes to a task, which fails it over to the
    next engine as the task path does (nothing reached the client). Catches: a stream's head taken
    for its first byte (the client stuck with a hung engine), the budget not armed for a stream
    sent from callbacks, a fail-over answered twice or its first attempt's load kept."""
    engines = [ScriptedEngine(), ScriptedEngine()]
    try:
        recorder = Recorder()
        server = _router(serve_asgi, engines, recorder, callback_path, limits={"first_byte_timeout_s": 0.5})
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            for _ in range(2):  # warm: an idle pooled connection to each engine
                sock.sendall(post("/v1/chat/completions", chat(stream=True)))
                (answer,) = read_answers(sock, 1)
                assert answer.status_code == 200
            task_starts.clear()
            for _ in range(2):
                sock.sendall(post("/v1/chat/completions", chat(stream=True)))
                (answer,) = read_answers(sock, 1)
                assert answer.status_code == 200 and b"data: [DONE]" in answer.content
            assert task_starts == [] or server.server.config.app.proxy_now is None
            engines[0].stall_s = 30.0
            answers = []
            while engines[0].stalled == 0:  # until a stream is routed to the stalled engine
                sock.sendall(post("/v1/chat/completions", chat(stream=True)))
                answers += read_answers(sock, 1)
        assert answers[-1].status_code == 200 and answers[-1].headers["x-kvroute-engine"] == "e1"
        assert _events(answers[-1].content)[-1] == DONE.strip()
        _wait_for(lambda: any(r["attempts"] == ["e0", "e1"] for r in recorder.finished), "the fail-over")
        (record,) = [r for r in recorder.finished if r["attempts"] == ["e0", "e1"]]
        assert record["status"] == 200 and record["usage"] == USAGE
        if server.server.config.app.proxy_now is not None:
            assert len(task_starts) == 1  # the stalled stream only
        metrics = httpx.get(server.url + "/metrics").text
        assert 'kvroute_upstream_errors_total{engine="e0",kind="first_byte_timeout"} 1.0' in metrics
        tracker = server.server.config.app.state.tracker
        assert tracker.load("e0")[0] == 0 and tracker.load("e1")[0] == 0
    finally:
        for engine in engines:
            engine.stop_listening()


def _router_buffered_bytes(server: ThreadedServer) -> int:
    """Bytes the router holds for its clients: its client transports' write buffers and the
    upstream answers' unread pieces (read on the router's event loop)."""
    router = server.server.config.app.state.router
    loop = router.client._loop
    assert loop is not None

    async def count() -> int:
        held = sum(p.transport.get_write_buffer_size() for p in server.server.server_state.connections)
        for conn in router.client._running:
            if conn.response is not None:
                held += sum(map(len, conn.response._chunks))
        return held

    return asyncio.run_coroutine_threadsafe(count(), loop).result(10)


@PATHS
def test_a_slow_client_holds_the_engine_back_and_gets_the_whole_answer(
    serve_asgi: Callable[..., ThreadedServer],
    engine: ScriptedEngine,
    relay_generators: list[str],
    callback_path: bool,
) -> None:
    """A 64 MiB stream (4,096 events of 16 KiB) to a client that stops reading after the head: on the
    callback path the client transport's pause pauses the engine's connection, on the task path
    (whose generator waits on the client's drain) the bytes waiting for it over
    ``proxy.STREAM_BUFFER_BYTES`` do; so the router holds at most about a write buffer and a read or
    two (never the answer: more than the kernel's socket buffers on both hops can take, so the
    engine must stall), and once the client reads on, the answer arrives whole."""
    piece = "x" * (16384 - 80)
    engine.events = token_events(4096, piece)
    engine.piece_bytes = 1 << 20
    recorder = Recorder()
    server = _router(serve_asgi, engine, recorder, callback_path=callback_path)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)  # (before connecting: the window)
    try:
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(post("/v1/chat/completions", chat(stream=True)))
        sock.settimeout(30)
        data = bytearray()
        while b"\r\n\r\n" not in data:
            data += sock.recv(4096)
        # The client reads nothing more until the engine has stalled (no progress for 0.5 s) or,
        # had nothing held it back, finished.
        most_held, last_sent, still_since = 0, -1, time.monotonic()
        deadline = time.monotonic() + 60
        while engine.finished == 0 and time.monotonic() - still_since < 0.5:
            assert time.monotonic() < deadline, "the engine neither stalled nor finished"
            most_held = max(most_held, _router_buffered_bytes(server))
            if engine.sent_bytes != last_sent:
                last_sent, still_since = engine.sent_bytes, time.monotonic()
            time.sleep(0.02)
        assert engine.finished == 0, f"the whole answer left the engine ({engine.sent_bytes} bytes)"
        assert most_held <= 1 << 20, f"the router held {most_held} bytes"
        # Now the client reads on: every event arrives, then the chunked terminator.
        read_to_last_chunk(sock, data)
    finally:
        sock.close()
    assert chunked_body(data) == b"".join([*engine.events, DONE])
    assert engine.finished == 1
    _wait_for(lambda: len(recorder.finished) == 1, "the finished stream")
    assert recorder.finished[0]["status"] == 200 and recorder.finished[0]["usage"] == USAGE
    _check_relay(server, relay_generators, 1)


def test_the_usage_stripper_takes_out_only_the_usage_event_whatever_the_events_around_it() -> None:
    """``_UsageChunkStripper.feed`` (round dp23: only events holding ``"usage"`` are decoded):
    the usage-only event goes, every other byte stays - a token event whose text says "usage",
    one with a usage object and choices, an empty event between separators, a keep-alive comment,
    an event after a stray third newline - fed whole and byte by byte. Catches a kept event's
    separator lost or doubled when the others are joined, and an event dropped for the word."""
    wordy = event({"choices": [{"index": 0, "delta": {"content": '"usage"'}}]})
    with_choices = event({"choices": [{"index": 0, "delta": {}}], "usage": USAGE})
    kept = [b": keep-alive\n\n", *token_events(2), wordy, b"\n\n", with_choices, b"\n" + token_events(1)[0]]
    stream = b"".join([*kept, USAGE_EVENT, DONE])
    for pieces in ([stream], [stream[i : i + 1] for i in range(len(stream))]):
        stripper = _UsageChunkStripper()
        out = b"".join(stripper.feed(piece) for piece in pieces) + stripper.flush()
        assert out == b"".join([*kept, DONE])
        assert stripper.usage == USAGE and stripper.done
