"""The engine's answer as the upstream protocol (router/proxy.py) reads it, through the real router
on loopback, on both paths (a task awaiting ``UpstreamClient.send``, and the callback path's relay on
``send_on_idle``): the one header the router relays (content-type) taken off the raw header block in
any case, the last of two, application/json without one, also when the block comes in several reads;
chunked and content-length bodies; an engine's ``connection: close``; the engine's HTTP errors
relayed; malformed answers a 502. (Only the split header block's condition - the router has read
the pieces sent before the next goes - reads the router's internals.)"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ThreadedServer
from tests.test_callback_path import RawEngine, Recorder, _wait_for
from tests.test_fastpath import MODEL, chat
from tests.test_stream_relay import PATHS, _router

BODY = json.dumps(
    {
        "id": "c",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }
).encode()


def answer(head_lines: bytes, body: bytes = BODY, status: bytes = b"200 OK") -> bytes:
    """A content-length answer with ``head_lines`` (CRLF-ended header lines) in its header block."""
    return b"HTTP/1.1 %s\r\n%scontent-length: %d\r\n\r\n%s" % (status, head_lines, len(body), body)


class AnswerEngine(RawEngine):
    """Answers the n-th request with ``answers[n]`` (the last one for every request after), in
    pieces (each sent on its own; before each but the first, ``between(sent so far)`` is waited
    for), keeping the connection unless ``close`` is set."""

    def __init__(self, answers: list[list[bytes]], close: bool = False) -> None:
        self.answers = answers
        self.close = close
        self.between: Callable[[bytes], None] | None = None
        self.connections = 0
        self.requests = 0
        self.lock = threading.Lock()
        super().__init__()

    def _serve(self, conn: socket.socket) -> None:
        with self.lock:
            self.connections += 1
        with conn:
            for _ in self.each_request(conn):
                with self.lock:
                    pieces = self.answers[min(self.requests, len(self.answers) - 1)]
                    self.requests += 1
                try:
                    for i, piece in enumerate(pieces):
                        if i and self.between is not None:
                            self.between(b"".join(pieces[:i]))
                        conn.sendall(piece)
                except OSError:
                    return
                if self.close:
                    return


@pytest.fixture
def engines() -> Iterator[list[AnswerEngine]]:
    made: list[AnswerEngine] = []
    try:
        yield made
    finally:
        for engine in made:
            engine.stop_listening()


def _serve(
    serve_asgi: Callable[..., ThreadedServer],
    engines: list[AnswerEngine],
    callback_path: bool,
    answers: list[list[bytes]],
    close: bool = False,
) -> tuple[AnswerEngine, ThreadedServer]:
    engine = AnswerEngine(answers, close)
    engines.append(engine)
    return engine, _router(serve_asgi, engine, Recorder(), callback_path)


def _post(server: ThreadedServer, client: httpx.Client) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return client.post(server.url + "/v1/chat/completions", content=chat(), headers=headers, timeout=10)


CONTENT_TYPES = {
    "lower-case": (b"content-type: text/plain; charset=utf-8\r\n", "text/plain; charset=utf-8"),
    "upper-case, tab": (b"CONTENT-TYPE:\t application/x-ndjson\r\n", "application/x-ndjson"),
    "mixed case, after others": (b"x-a: 1\r\nContent-Type: application/json\r\n", "application/json"),
    "the last of two": (b"content-type: text/a\r\nx-b: 2\r\ncontent-type: text/b\r\n", "text/b"),
    "a look-alike name only": (b"x-content-type: text/a\r\ncontent-typex: text/b\r\n", "application/json"),
    "none": (b"x-c: 3\r\n", "application/json"),
}


@PATHS
@pytest.mark.parametrize("case", list(CONTENT_TYPES))
def test_the_engines_content_type_is_relayed(
    serve_asgi: Callable[..., ThreadedServer], engines: list[AnswerEngine], callback_path: bool, case: str
) -> None:
    head_lines, expected = CONTENT_TYPES[case]
    engine, server = _serve(serve_asgi, engines, callback_path, [[answer(head_lines)]])
    with httpx.Client() as client:
        for _ in range(3):  # the first on a new connection, the next on the pooled one
            got = _post(server, client)
            assert got.status_code == 200
            assert got.headers["content-type"] == expected
            assert got.content == BODY
    assert engine.connections == 1


@PATHS
@pytest.mark.parametrize("cut", ["a byte at a time", "inside the name", "inside the value", "before the end"])
def test_a_header_block_across_reads(
    serve_asgi: Callable[..., ThreadedServer], engines: list[AnswerEngine], callback_path: bool, cut: str
) -> None:
    """Each piece is sent once the router has read the ones before it (the condition is on the
    router's side), so the header block reaches the upstream protocol in several reads."""
    wire = answer(b"x-a: 1\r\nContent-Type: text/split\r\nx-b: 2\r\n")
    head_end = wire.index(b"\r\n\r\n") + 4
    if cut == "a byte at a time":
        pieces = [wire[i : i + 1] for i in range(head_end - 1)] + [wire[head_end - 1 :]]
    else:
        at = {
            "inside the name": wire.index(b"Content-T") + 5,
            "inside the value": wire.index(b"text/split") + 4,
            "before the end": head_end - 2,
        }[cut]
        pieces = [wire[:at], wire[at:]]
    engine, server = _serve(serve_asgi, engines, callback_path, [[wire], pieces])
    router = server.server.config.app.state.router

    def read_by_the_router(sent: bytes) -> None:
        # The router's connection holds what it has read of a header block not complete yet (the
        # last piece completes it).
        _wait_for(
            lambda: any(conn.head == sent for conn in list(router.client._running)),
            "the router to read the pieces sent",
        )

    with httpx.Client() as client:
        got = _post(server, client)  # a whole answer first: the connection is pooled
        engine.between = read_by_the_router
        for _ in range(2):
            got = _post(server, client)
            assert got.status_code == 200
            assert got.headers["content-type"] == "text/split"
            assert got.content == BODY
    assert engine.connections == 1


@PATHS
def test_a_chunked_answer(
    serve_asgi: Callable[..., ThreadedServer], engines: list[AnswerEngine], callback_path: bool
) -> None:
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (BODY[:10], BODY[10:]))
    wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\ncontent-type: application/json\r\n\r\n"
    engine, server = _serve(serve_asgi, engines, callback_path, [[wire + chunks + b"0\r\n\r\n"]])
    with httpx.Client() as client:
        for _ in range(3):
            got = _post(server, client)
            assert got.status_code == 200 and got.content == BODY
    assert engine.connections == 1


@PATHS
def test_the_engine_closing_after_its_answer(
    serve_asgi: Callable[..., ThreadedServer], engines: list[AnswerEngine], callback_path: bool
) -> None:
    engine, server = _serve(
        serve_asgi, engines, callback_path, [[answer(b"Connection: close\r\n")]], close=True
    )
    with httpx.Client() as client:
        for _ in range(3):
            got = _post(server, client)
            assert got.status_code == 200 and got.content == BODY
    assert engine.connections == 3  # not kept: each request on a new connection


@PATHS
def test_the_engines_http_error_is_relayed(
    serve_asgi: Callable[..., ThreadedServer], engines: list[AnswerEngine], callback_path: bool
) -> None:
    error = b'{"object": "error", "message": "no such model", "code": 404}'
    wire = answer(b"content-type: application/problem+json\r\n", error, b"404 Not Found")
    engine, server = _serve(serve_asgi, engines, callback_path, [[wire]])
    with httpx.Client() as client:
        for _ in range(2):
            got = _post(server, client)
            assert got.status_code == 404
            assert got.headers["content-type"] == "application/problem+json"
            assert got.content == error
    assert engine.connections == 1


MALFORMED = {
    "not HTTP": b"SSH-2.0-OpenSSH\r\n\r\n",
    "LF line ends": b"HTTP/1.1 200 OK\ncontent-type: a/b\ncontent-length: 2\n\nok",
    "folded header": b"HTTP/1.1 200 OK\r\ncontent-type: a/b\r\n c/d\r\ncontent-length: 2\r\n\r\nok",
    "space before the colon": b"HTTP/1.1 200 OK\r\ncontent-type : a/b\r\ncontent-length: 2\r\n\r\nok",
    "a NUL in a value": b"HTTP/1.1 200 OK\r\ncontent-type: a\x00b\r\ncontent-length: 2\r\n\r\nok",
    "a bad chunk size": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nok\r\n0\r\n\r\n",
}


@PATHS
@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_answer_is_a_502(
    serve_asgi: Callable[..., ThreadedServer], engines: list[AnswerEngine], callback_path: bool, case: str
) -> None:
    # A whole answer first, so that on the callback path the malformed one comes on a pooled
    # connection (send_on_idle) as it would there.
    engine, server = _serve(serve_asgi, engines, callback_path, [[answer(b"")], [MALFORMED[case]]])
    with httpx.Client() as client:
        assert _post(server, client).status_code == 200
        got = _post(server, client)
    assert engine.requests == 2  # not sent again (a malformed answer is not a stale connection)
    assert got.status_code == 502
    error: dict[str, Any] = got.json()["error"]
    assert error["code"] == "upstream_error" and error["type"] == "upstream_error"
    assert "malformed HTTP answer" in error["message"]
