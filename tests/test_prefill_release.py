"""A non-stream answer's prefill release (router/routing.py ``_answer_started``), on real sockets
and both paths: scheduled at the predicted TTFT when the engine's headers come before its body (the
queue stops counting the prefill while the body is still due), not scheduled when the whole answer
is in with its headers (the finish, which follows at once, releases it with the load)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

import pytest

from router.app import create_app
from router.routing import _DueCalls
from tests.conftest import ThreadedServer
from tests.test_callback_path import RawEngine, _wait_for, completion_answer
from tests.test_fastpath import chat, post, read_answers, round_robin_config

HEAD, _, BODY = completion_answer(completion_id="p-1").partition(b"\r\n\r\n")
HEAD += b"\r\n\r\n"


class HeadFirstEngine(RawEngine):
    """Answers every request on a keep-alive connection: head and body in one write (``whole``),
    or the head, then the body once ``release`` is set."""

    def __init__(self, whole: bool) -> None:
        self.whole = whole
        self.release = threading.Event()
        super().__init__()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            data = b""
            while (read := self.read_request(conn, data)) is not None:
                data = read[1]
                if self.whole:
                    conn.sendall(HEAD + BODY)
                    continue
                conn.sendall(HEAD)
                self.release.wait(10)
                conn.sendall(BODY)


class CountingDueCalls(_DueCalls):
    """The router's own due-call queue, counting what is added to it."""

    def __init__(self, call: Callable[[Any], None]) -> None:
        super().__init__(call)
        self.added = 0

    def add(self, delay_s: float, item: Any) -> None:
        self.added += 1
        super().add(delay_s, item)


def _serve(serve_asgi: Callable[..., ThreadedServer], url: str, callback_path: bool) -> ThreadedServer:
    return serve_asgi(create_app(round_robin_config([url], callback_path=callback_path)))


@pytest.mark.parametrize("callback_path", [False, True])
def test_a_whole_answer_schedules_no_release_and_leaves_no_load(
    serve_asgi: Callable[..., ThreadedServer], callback_path: bool
) -> None:
    """Fails when a whole answer still schedules the release (main before round dp15) or when the
    finish does not release its prefill (the load left queued)."""
    engine = HeadFirstEngine(whole=True)
    try:
        server = _serve(serve_asgi, engine.url, callback_path)
        router = server.server.config.app.state.router
        due = router._prefill_releases = CountingDueCalls(router.core.release_prefill)
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            for i in range(3):
                sock.sendall(post("/v1/chat/completions", chat(text=f"q{i}")))
                assert [a.status_code for a in read_answers(sock, 1)] == [200]
        tracker = server.server.config.app.state.tracker
        _wait_for(lambda: tracker.load("e0") == (0, 0), "the load given back")
        assert due.added == 0
    finally:
        engine.stop_listening()


@pytest.mark.parametrize("callback_path", [False, True])
def test_headers_before_the_body_release_the_prefill_at_the_predicted_ttft(
    serve_asgi: Callable[..., ThreadedServer], callback_path: bool
) -> None:
    """The engine sends its head and holds the body: the release is scheduled, and runs (queued
    prefill 0) while the request is still in flight; then the body, and no load is left."""
    engine = HeadFirstEngine(whole=False)
    try:
        server = _serve(serve_asgi, engine.url, callback_path)
        router = server.server.config.app.state.router
        due = router._prefill_releases = CountingDueCalls(router.core.release_prefill)
        tracker = server.server.config.app.state.tracker
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(post("/v1/chat/completions", chat()))
            _wait_for(lambda: due.added == 1, "the release scheduled")
            _wait_for(lambda: tracker.load("e0") == (1, 0), "the prefill released, the request in flight")
            engine.release.set()
            assert [a.status_code for a in read_answers(sock, 1)] == [200]
        _wait_for(lambda: tracker.load("e0") == (0, 0), "the load given back")
    finally:
        engine.release.set()
        engine.stop_listening()
