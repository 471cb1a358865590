"""The callback path (proxy.callback_path, router/fastpath.py + Router.serve_now), on real sockets:
warm non-stream requests are answered without an asyncio task, with everything the task path does
(usage, metrics counted once, errors, the reservation given back when the client goes away), and
what it cannot finish in callbacks goes on as a task from where it stopped (a stale pooled
connection retried, fail-over to the next engine, streams with their usage chunk stripped)."""

from __future__ import annotations

import json
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from router.app import create_app
from router.config import load_config
from router.routing import RouteContext
from tests.conftest import OpenAIUpstream, ThreadedServer, free_port
from tests.test_fastpath import MODEL, chat, post, read_answers


class Recorder:
    """A route observer keeping what each finished request looked like."""

    def __init__(self) -> None:
        self.finished: list[dict[str, Any]] = []

    def on_routed(self, ctx: RouteContext) -> None:
        return None

    def on_first_byte(self, ctx: RouteContext) -> None:
        return None

    def on_finished(self, ctx: RouteContext) -> None:
        self.finished.append(
            {
                "id": ctx.request_id,
                "status": ctx.http_status,
                "usage": ctx.usage,
                "attempts": list(ctx.attempts),
                "engine": ctx.engine_id,
            }
        )


def completion_answer(
    content: str = "ok", completion_id: str = "c-1", usage: dict[str, int] | None = None
) -> bytes:
    """A whole non-stream chat completion as an engine writes it: status line, content-length
    head and the JSON body."""
    body = json.dumps(
        {
            "id": completion_id,
            "object": "chat.completion",
            "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
            "usage": usage or {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
        }
    ).encode()
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


class RawEngine:
    """A raw HTTP/1.1 engine on loopback: one thread per connection, served by the subclass's
    ``_serve`` (``read_request`` reads one request off it); ``stop_listening`` refuses new
    connections while open ones stay."""

    def __init__(self) -> None:
        self.port = free_port()
        self.listener = socket.create_server(("127.0.0.1", self.port))
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    @staticmethod
    def read_request(conn: socket.socket, data: bytes) -> tuple[bytes, bytes] | None:
        """The next request's body off ``conn`` (``data``: bytes already read) and the bytes read
        past it; None when the client closed the connection first."""
        while b"\r\n\r\n" not in data:
            more = conn.recv(65536)
            if not more:
                return None
            data += more
        head, data = data.split(b"\r\n\r\n", 1)
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(data) < length:
            data += conn.recv(65536)
        return data[:length], data[length:]

    def each_request(self, conn: socket.socket) -> Iterator[bytes]:
        """The bodies of the requests ``conn`` sends, one at a time, until the client closes it
        (no Nagle delay on the answers written between them)."""
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        data = b""
        while True:
            read = self.read_request(conn, data)
            if read is None:
                return
            body, data = read
            yield body

    def stop_listening(self) -> None:
        self._stop.set()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() and stops listening (Linux)
        except OSError:
            pass
        self.listener.close()


class FlakyEngine(RawEngine):
    """Answers the first request of each connection (keep-alive) and closes the connection,
    unanswered, on any later one - a pooled connection gone stale."""

    def __init__(self) -> None:
        self.requests = 0
        self.answered = 0
        self.bodies: list[bytes] = []
        super().__init__()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            for number in range(2):
                read = self.read_request(conn, data)
                if read is None:
                    return
                data = read[1]
                self.bodies.append(read[0])
                self.requests += 1
                if number == 1:
                    return  # the second request on a connection: closed unanswered
                self.answered += 1
                conn.sendall(completion_answer(completion_id="flaky-1"))


def _router(
    serve_asgi: Callable[..., ThreadedServer],
    engines: list[tuple[str, str]],
    recorder: Recorder,
    callback_path: bool | str = True,
) -> ThreadedServer:
    config = load_config(
        environ={},
        overrides={
            "engines": [{"id": name, "url": url, "model": MODEL} for name, url in engines],
            "health": {"interval_s": 0},
            "policy": {"name": "round_robin"},
            "proxy": {"callback_path": callback_path},
        },
    )
    return serve_asgi(create_app(config, observers=[recorder]))


@pytest.fixture
def flaky() -> Iterator[FlakyEngine]:
    engine = FlakyEngine()
    try:
        yield engine
    finally:
        engine.stop_listening()


def _count(metrics: str, status: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("kvroute_requests_total{") and f'status="{status}"' in line
    )


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_warm_requests_are_answered_without_a_task_and_counted_once(
    serve_asgi: Callable[..., ThreadedServer], upstreams: Any, task_starts: list[object]
) -> None:
    """Catches: the path silently falling back to tasks; the usage of a non-stream answer not
    read; an answer finished twice (metrics, load) or never (load left reserved)."""
    engines = upstreams(2)
    recorder = Recorder()
    server = _router(serve_asgi, [(u.name, url) for u, url in engines], recorder)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        warm = read_answers(sock, 0)
        for _ in range(2):  # a keep-alive connection to each engine (the first ones are tasks)
            sock.sendall(post("/v1/chat/completions", chat()))
            warm += read_answers(sock, 1)
        task_starts.clear()
        answers = []
        for i in range(6):
            sock.sendall(post("/v1/chat/completions", chat(text=f"q{i}")))
            answers += read_answers(sock, 1)
    assert [a.status_code for a in warm + answers] == [200] * 8
    assert task_starts == []  # every warm request was answered in callbacks
    assert all(a.json()["object"] == "chat.completion" for a in answers)
    assert [a.headers["x-kvroute-engine"] for a in answers] == ["e0", "e1"] * 3 or [
        a.headers["x-kvroute-engine"] for a in answers
    ] == ["e1", "e0"] * 3
    ids = [a.headers["x-request-id"] for a in answers]
    _wait_for(lambda: len(recorder.finished) == 8, "8 finished requests")
    finished = {r["id"]: r for r in recorder.finished}
    assert len(finished) == 8  # each request finished once
    for request_id in ids:
        record = finished[request_id]
        assert record["status"] == 200
        assert record["usage"]["prompt_tokens_details"] == {"cached_tokens": 7}
        assert record["attempts"] == [record["engine"]]
    metrics = httpx.get(server.url + "/metrics").text
    assert _count(metrics, "200") == 8
    tracker = server.server.config.app.state.tracker
    assert all(tracker.load(name)[0] == 0 for name in ("e0", "e1"))


def test_streams_and_errors_on_the_callback_path(
    serve_asgi: Callable[..., ThreadedServer], upstreams: Any
) -> None:
    """Catches: a stream relayed without the router's usage chunk stripped (the client did not ask
    for usage) or without the usage read; router errors and an engine's error status answered
    differently from the task path."""
    engines = upstreams(1)
    upstream: OpenAIUpstream = engines[0][0]
    recorder = Recorder()
    server = _router(serve_asgi, [(u.name, url) for u, url in engines], recorder)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(post("/v1/chat/completions", chat()))  # warm: an idle connection to the engine
        sock.sendall(post("/v1/chat/completions", chat(stream=True)))
        warm, stream = read_answers(sock, 2)
        assert warm.status_code == 200 and stream.status_code == 200
        assert b"data: [DONE]" in stream.content and b'"usage"' not in stream.content
        assert json.loads(upstream.bodies[-1])["stream_options"] == {"include_usage": True}

        sock.sendall(post("/v1/chat/completions", b'{"model": "test-model", "messages": ['))
        (bad,) = read_answers(sock, 1)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
        assert bad.headers["x-request-id"]
        sock.sendall(post("/v1/chat/completions", chat().replace(MODEL.encode(), b"other-model")))
        (unknown,) = read_answers(sock, 1)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"

        upstream.fail_status = 503
        sock.sendall(post("/v1/chat/completions", chat()))
        (failed,) = read_answers(sock, 1)
        assert failed.status_code == 503 and failed.json()["error"]["message"] == "e0 says no"
        assert failed.headers["x-kvroute-engine"] == "e0"
    _wait_for(lambda: len(recorder.finished) == 3, "3 finished requests")
    stream_record = recorder.finished[1]
    assert stream_record["status"] == 200 and stream_record["usage"]["completion_tokens"] == 3
    metrics = httpx.get(server.url + "/metrics").text
    assert _count(metrics, "400") == 1 and _count(metrics, "404") == 1 and _count(metrics, "503") == 1
    assert 'kvroute_upstream_errors_total{engine="e0",kind="http_503"} 1.0' in metrics


@pytest.mark.parametrize("text", ["hi", "a long prompt " * 8000], ids=["short", "scattered"])
def test_a_stale_pooled_connection_is_retried_on_a_new_one(
    serve_asgi: Callable[..., ThreadedServer], flaky: FlakyEngine, text: str
) -> None:
    """The request written in callbacks on an idle connection the engine then closes unanswered:
    handed over to a task that sends it once more on a new connection. Catches: a 502 for a
    connection that was only stale, or the request finished twice; with a body past
    router.proxy.SCATTER_BODY_BYTES (written as a head and a body), a resent request that lost
    either."""
    recorder = Recorder()
    server = _router(serve_asgi, [("flaky", flaky.url)], recorder)
    body = chat(text=text)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        for _ in range(2):
            sock.sendall(post("/v1/chat/completions", body))
            (answer,) = read_answers(sock, 1)
            assert answer.status_code == 200 and answer.json()["id"] == "flaky-1"
    assert flaky.requests == 3 and flaky.answered == 2  # the second went out twice
    assert flaky.bodies == [body] * 3
    assert server.server.config.app.state.router.client.stale_retries == 1
    _wait_for(lambda: len(recorder.finished) == 2, "2 finished requests")
    assert [r["status"] for r in recorder.finished] == [200, 200]
    assert recorder.finished[1]["attempts"] == ["flaky"]


@pytest.mark.parametrize("callback_path", [True, False], ids=["callbacks", "task"])
def test_a_large_body_in_many_reads_reaches_the_engine_whole(
    serve_asgi: Callable[..., ThreadedServer], upstreams: Any, callback_path: bool
) -> None:
    """A ~290 KB chat body (past uvicorn's 64 KiB read pause, longer than one read, and past
    router.proxy.SCATTER_BODY_BYTES: it goes to the engine as a head and a body in one scatter
    write) sent in 4 KB writes, twice on one connection (the second on the pooled upstream
    connection), on both paths: the engine gets it byte for byte, the client its answers.
    Catches: a body's chunks lost or out of order when the exchange holds them (``add_chunk``,
    joined once when taken), its size misread against limits.max_body_bytes, a scatter write that
    drops the head or the body."""
    ((upstream, url),) = upstreams(1)
    server = _router(serve_asgi, [("e0", url)], Recorder(), callback_path=callback_path)
    body = chat(text="".join(f"{i:06d} " for i in range(40_000)))
    request = post("/v1/chat/completions", body)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(2):
            for at in range(0, len(request), 4096):
                sock.sendall(request[at : at + 4096])
            (answer,) = read_answers(sock, 1)
            assert answer.status_code == 200, answer.text
    assert upstream.bodies == [body, body]


def test_an_engine_gone_before_answering_fails_over(
    serve_asgi: Callable[..., ThreadedServer], upstreams: Any, flaky: FlakyEngine
) -> None:
    """The engine closes the pooled connection unanswered and refuses a new one: the request goes
    to the next engine, as on the task path. Catches: a failure before any byte passed on to the
    client instead of the fail-over, the failed engine's load kept reserved."""
    engines = upstreams(1)
    recorder = Recorder()
    server = _router(serve_asgi, [("flaky", flaky.url), (engines[0][0].name, engines[0][1])], recorder)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        while flaky.answered == 0:  # until the flaky engine holds an idle pooled connection
            sock.sendall(post("/v1/chat/completions", chat()))
            (answer,) = read_answers(sock, 1)
            assert answer.status_code == 200
        flaky.stop_listening()
        answers = []
        while flaky.requests == flaky.answered:  # until a request is routed to the flaky engine
            sock.sendall(post("/v1/chat/completions", chat()))
            answers += read_answers(sock, 1)
    assert answers[-1].status_code == 200 and answers[-1].headers["x-kvroute-engine"] == "e0"
    _wait_for(lambda: any(r["attempts"] == ["flaky", "e0"] for r in recorder.finished), "the fail-over")
    (record,) = [r for r in recorder.finished if r["attempts"] == ["flaky", "e0"]]
    assert record["status"] == 200 and record["engine"] == "e0"
    tracker = server.server.config.app.state.tracker
    assert tracker.load("flaky")[0] == 0 and tracker.load("e0")[0] == 0
    assert (
        'kvroute_upstream_errors_total{engine="flaky",kind="connect"} 1.0'
        in httpx.get(server.url + "/metrics").text
    )


def test_client_gone_before_the_answer_cancels_and_gives_the_load_back(
    serve_asgi: Callable[..., ThreadedServer], upstreams: Any, task_starts: list[object]
) -> None:
    """Catches: a disconnect on the callback path not noticed (the engine's request left running,
    the engine's load left reserved, no 499 counted) or counted twice."""
    engines = upstreams(1)
    upstream: OpenAIUpstream = engines[0][0]
    recorder = Recorder()
    server = _router(serve_asgi, [(u.name, url) for u, url in engines], recorder)
    tracker = server.server.config.app.state.tracker
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(post("/v1/chat/completions", chat()))  # warm: an idle connection to the engine
        (warm,) = read_answers(sock, 1)
        assert warm.status_code == 200
    task_starts.clear()
    upstream.delay_s = 30.0
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(post("/v1/chat/completions", chat(text="slow")))
        _wait_for(lambda: len(upstream.bodies) == 2, "the request at the engine")
        assert tracker.load("e0")[0] == 1
    _wait_for(lambda: len(recorder.finished) == 2, "the disconnect")
    assert recorder.finished[1]["status"] == 499
    assert task_starts == []
    assert tracker.load("e0")[0] == 0
    upstream.delay_s = 0.0
    assert len(recorder.finished) == 2
    assert _count(httpx.get(server.url + "/metrics").text, "499") == 1


class HeldEngine(RawEngine):
    """Answers each request at once, but one whose body holds ``"hold"`` only once ``release`` is
    set (``arrived`` gets one item per held request as it starts waiting)."""

    def __init__(self) -> None:
        self.arrived: queue.Queue[bytes] = queue.Queue()
        self.release = threading.Event()
        super().__init__()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            for body in self.each_request(conn):
                if b"hold" in body:
                    self.arrived.put(body)
                    self.release.wait(30)
                conn.sendall(completion_answer())


@pytest.mark.parametrize("callback_path", [True, "idle", 2])
def test_the_callback_path_only_while_fewer_other_exchanges_than_its_gate_are_in_progress(
    serve_asgi: Callable[..., ThreadedServer], task_starts: list[object], callback_path: bool | str | int
) -> None:
    """proxy.callback_path = "idle" (the default) or N: a warm request goes the callback path while
    the router has fewer than 1 (N) other exchanges with an engine in progress, and as a task
    otherwise (the engine holds requests), though an idle pooled connection is there for it;
    ``true`` takes the callback path either way. Catches: the gate not applied (under load the task
    path serves more a second: docs/benchmarks.md), applied with ``true``, N read as "idle" (or as
    one more or less), or an exchange never leaving the set (every later request a task)."""
    if os.environ.get("TEST_KVROUTE_CALLBACK_PATH") in ("0", "1"):
        pytest.skip("TEST_KVROUTE_CALLBACK_PATH sets the path for the whole run")
    below = {True: 10**9, "idle": 1, 2: 2}[callback_path]
    engine = HeldEngine()
    try:
        server = _router(serve_asgi, [("e0", engine.url)], Recorder(), callback_path=callback_path)
        with (
            socket.create_connection(("127.0.0.1", server.port)) as first,
            socket.create_connection(("127.0.0.1", server.port)) as second,
            socket.create_connection(("127.0.0.1", server.port)) as third,
        ):

            def held(holders: list[socket.socket], then: Callable[[], None]) -> None:
                """``then`` run while the engine holds a request of each of ``holders``, sent one
                after the other once the one before is held."""
                engine.release.clear()
                for holder in holders:
                    holder.sendall(post("/v1/chat/completions", chat(text="hold")))
                    engine.arrived.get(timeout=10)
                then()
                engine.release.set()
                for holder in holders:
                    assert [a.status_code for a in read_answers(holder, 1)] == [200]

            def answered(text: str) -> None:
                first.sendall(post("/v1/chat/completions", chat(text=text)))
                assert [a.status_code for a in read_answers(first, 1)] == [200]

            held([second, third], lambda: answered("warm"))  # three pooled connections from here on
            task_starts.clear()
            answered("idle")
            assert task_starts == []  # nothing else in progress: callbacks
            held([second], lambda: None)
            assert task_starts == []  # the held request came to an idle router too
            held([second], lambda: answered("one busy"))
            assert len(task_starts) == (1 if below <= 1 else 0)  # "one busy" only
            task_starts.clear()
            held([second, third], lambda: answered("two busy"))
            # third's request came with one exchange in progress, "two busy" with two
            assert len(task_starts) == (below <= 1) + (below <= 2)
            task_starts.clear()
            answered("idle again")
            assert task_starts == []
    finally:
        engine.release.set()
        engine.stop_listening()
