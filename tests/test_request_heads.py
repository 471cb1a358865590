"""Request heads cut from the bytes the client protocol feeds (router/fastpath.py): the parser has
no ``on_header`` / ``on_url`` callback, each head is found from the bytes its callbacks account for
and parsed in C. What a request's scope says must be exactly what uvicorn's own ``on_url`` /
``on_header`` make of the same bytes (the oracle below runs llhttp with them): names in any case,
spaces and tabs around values, duplicate lines, obs-text, empty values, the request target,
chunked bodies with extensions and trailers, empty lines between pipelined requests; what llhttp
refuses (line folding, bare LF, a space before the colon, control bytes) is refused (400).

On real sockets (a guarded server on loopback; both paths: ``TEST_KVROUTE_CALLBACK_PATH=1`` puts
the proxied requests on the callback path), with heads split across reads at chosen points (the
test waits until the server holds the first part), and pipelined; and fed directly to the protocol
at every cut point of a pipelined sequence (where a read ends is the test's choice there)."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from collections.abc import Callable
from typing import Any

import httptools
import pytest

from router.config import load_config
from router.fastpath import HEADER_SLACK_BYTES
from tests.conftest import ThreadedServer
from tests.test_fastpath import read_answers
from tests.test_guard_pipelining import _connection

PROXIED = "/v1/chat/completions"


class _UvicornHeads:
    """The oracle: what uvicorn's httptools protocol makes of requests (its ``on_url`` and
    ``on_header``: names lower-cased, values without trailing spaces and tabs; trailers of a chunked
    body appended to the request's headers), and whether llhttp refuses the bytes."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.refused = False

    def on_message_begin(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value.rstrip(b" \t")))

    def on_headers_complete(self) -> None:
        self.body = b""

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        parsed = httptools.parse_url(self.url)
        self.requests.append(
            {
                "raw_path": parsed.path.decode("latin-1"),
                "query": (parsed.query or b"").decode("latin-1"),
                "headers": [[n.decode("latin-1"), v.decode("latin-1")] for n, v in self.headers],
                "body": self.body.decode("latin-1"),
            }
        )


def oracle(data: bytes) -> _UvicornHeads:
    heads = _UvicornHeads()
    parser = httptools.HttpRequestParser(heads)
    parser.set_dangerous_leniencies(lenient_data_after_close=True)
    try:
        parser.feed_data(data)
    except httptools.HttpParserError:
        heads.refused = True
    return heads


def _echo(scope: dict[str, Any], body: bytes) -> bytes:
    return json.dumps(
        {
            "raw_path": scope["raw_path"].decode("latin-1"),
            "query": scope["query_string"].decode("latin-1"),
            "headers": [[n.decode("latin-1"), v.decode("latin-1")] for n, v in scope["headers"]],
            "body": body.decode("latin-1"),
        }
    ).encode()


class EchoApp:
    """Answers every request with what its scope says (the proxied route through the exchange, as a
    task or on the callback path; anything else through ASGI), once its body is in."""

    proxy_paths = {PROXIED.encode(): PROXIED}
    proxy_now: Callable[[Any], bool] | None = None
    callback_busy = ()  # (as KvrouteApp's with proxy.callback_path true: never busy)
    callback_below = 1

    def __init__(self) -> None:
        class State:
            config = load_config(
                environ={}, overrides={"engines": [{"id": "e0", "url": "http://127.0.0.1:9", "model": "m"}]}
            )

        self.state = State()

    def callback_proxy(self, exchange: Any) -> bool:
        body = exchange.complete_body()
        if body is None:
            return False
        exchange.answer_now(200, [(b"content-type", b"application/json")], _echo(exchange.scope, body))
        return True

    async def proxy_app(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        answer = _echo(scope, body)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        await self.proxy_app(scope, receive, send)


def request(
    method: bytes = b"POST", target: bytes = PROXIED.encode(), head: bytes = b"", body: bytes = b"{}"
) -> bytes:
    framing = b"content-length: %d\r\n" % len(body) if body or method == b"POST" else b""
    return b"%s %s HTTP/1.1\r\nhost: x\r\n%s%s\r\n%s" % (method, target, head, framing, body)


def chunked(target: bytes = PROXIED.encode(), head: bytes = b"", trailers: bytes = b"") -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nTransfer-Encoding: chunked\r\n%s\r\n"
        b'3;ext=1\r\n{"a\r\n6\r\n": 1}\n\r\n0\r\n%s\r\n' % (target, head, trailers)
    )


#: Heads llhttp takes, with what uvicorn's callbacks would make of each.
TAKEN = {
    "names in any case": request(
        head=b"X-Request-ID: abc\r\nCONTENT-type: application/json\r\nx-ReQuEsT-iD: d\r\n"
    ),
    "spaces and tabs around values": request(head=b"a:  b \t\r\nc:\tda  e\t \r\nf:\r\ng:   \r\nh:i\r\n"),
    "duplicate lines": request(head=b"x-dup: 1\r\nx-dup: 2\r\nX-Dup: 3\r\n"),
    "obs-text and colons in values": request(
        head=b"v: caf\xc3\xa9 \xff\r\nw: a:b:c\r\nx: http://h:1/p?q\r\n"
    ),
    "a target with a query and extra spaces": b"POST  /v1/chat/completions?x=1&y=%20  HTTP/1.1\r\n"
    b"content-length: 2\r\n\r\n{}",
    "other methods and paths (ASGI)": request(b"GET", b"/ready?probe=1", b"accept: */*\r\n", b""),
    "a control-plane POST (ASGI)": request(b"POST", b"/admin/reload", b"x: y\r\n"),
    "a chunked body with extensions and trailers": chunked(
        head=b"x-a: 1\r\n", trailers=b"x-t: 2 \r\nX-U:3\r\n"
    ),
    "a chunked body without trailers": chunked(),
    "empty lines before a request line": b"\r\n\r\n" + request(head=b"x: 1\r\n"),
}

#: Heads llhttp refuses: the server answers 400 and closes, as uvicorn's own protocol does.
REFUSED = {
    "line folding": request(head=b"a: b\r\n  c\r\n"),
    "a bare LF": request(head=b"a: b\nc: d\r\n"),
    "a bare CR": request(head=b"a: b\rc: d\r\n"),
    "a space before the colon": request(head=b"a : b\r\n"),
    "no colon": request(head=b"abc\r\n"),
    "a control byte in a value": request(head=b"a: b\x01c\r\n"),
    "two different content-lengths": request(head=b"content-length: 5\r\n"),
}


def _expected(data: bytes) -> list[dict[str, Any]]:
    heads = oracle(data)
    assert not heads.refused, data
    return heads.requests


def _wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def _holding_a_partial_head(server: ThreadedServer) -> bool:
    return any(getattr(c, "_carry", None) for c in list(server.server.server_state.connections))


def _send(server: ThreadedServer, data: bytes, cuts: tuple[int, ...] = ()) -> socket.socket:
    """``data`` on a new connection, in reads cut at ``cuts`` (each cut inside a head: the next part
    goes once the server holds the head's first part)."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    start = 0
    for cut in cuts:
        sock.sendall(data[start:cut])
        _wait_until(lambda: _holding_a_partial_head(server))
        start = cut
    sock.sendall(data[start:])
    return sock


def _answers(sock: socket.socket, count: int) -> list[dict[str, Any]]:
    with sock:
        answers = read_answers(sock, count)
    assert [a.status_code for a in answers] == [200] * count, [a.text for a in answers]
    return [json.loads(a.content) for a in answers]


@pytest.fixture
def echo_server(serve_asgi: Callable[..., ThreadedServer]) -> ThreadedServer:
    return serve_asgi(EchoApp())


@pytest.mark.parametrize("case", sorted(TAKEN))
def test_a_head_says_what_uvicorn_would_make_of_it(echo_server: ThreadedServer, case: str) -> None:
    data = TAKEN[case]
    assert _answers(_send(echo_server, data), 1) == _expected(data)


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_head_llhttp_refuses_is_answered_400(echo_server: ThreadedServer, case: str) -> None:
    data = REFUSED[case]
    assert oracle(data).refused
    with _send(echo_server, data) as sock:
        sock.settimeout(10)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n"), answer[:100]


def test_a_head_split_across_two_reads_anywhere(echo_server: ThreadedServer) -> None:
    """Cut inside the request line, a name, between a name and its colon's value, inside a value,
    between a CR and its LF, and inside the blank line: the same scope each time."""
    data = request(head=b"X-Request-Id: abc-1\r\nX-Other:  v w \r\n")
    expected = _expected(data)
    head_end = data.index(b"\r\n\r\n")
    name = data.index(b"X-Request-Id")
    value = data.index(b"abc-1")
    for cut in (5, name + 3, value - 1, value + 2, value + 5, head_end + 1, head_end + 2, head_end + 3):
        assert _answers(_send(echo_server, data, (cut,)), 1) == expected, cut


def test_pipelined_requests_each_with_its_own_head(echo_server: ThreadedServer) -> None:
    """A proxied request, a control-plane one, a chunked one with trailers, empty lines and another
    proxied one, in one write and then cut inside the later heads: every answer in order, each
    request's headers its own."""
    parts = [
        request(head=b"x-request-id: first\r\n", body=b'{"a": "\r\n\r\nPOST / HTTP/1.1\r\n"}'),
        request(b"GET", b"/v1/models", b"x-request-id: second\r\n", b""),
        chunked(head=b"x-request-id: third\r\n", trailers=b"x-t: 1\r\n"),
        b"\r\n",
        request(head=b"X-Request-Id: fourth\r\n"),
    ]
    data = b"".join(parts)
    expected = _expected(data)
    ids = [dict(map(tuple, r["headers"])).get("x-request-id") for r in expected]
    assert ids == ["first", "second", "third", "fourth"]
    assert _answers(_send(echo_server, data), 4) == expected
    second = len(parts[0]) + 20
    fourth = len(data) - len(parts[4]) + 30
    assert _answers(_send(echo_server, data, (second, fourth)), 4) == expected


class _RecordingEcho(EchoApp):
    """EchoApp on the callback path, recording each request's echo."""

    def __init__(self) -> None:
        super().__init__()
        self.echoes: list[dict[str, Any]] = []
        self.proxy_now = self.callback_proxy

    def callback_proxy(self, exchange: Any) -> bool:
        body = exchange.complete_body()
        if body is None:
            return False
        self.echoes.append(json.loads(_echo(exchange.scope, body)))
        exchange.answer_now(200, [(b"content-type", b"application/json")], b"{}")
        return True

    async def proxy_app(self, scope: Any, receive: Any, send: Any) -> None:  # (a pipelined request)
        message = await receive()
        assert not message.get("more_body")
        self.echoes.append(json.loads(_echo(scope, message["body"])))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"{}"})


def _fed_at_cuts(data: bytes, cuts: list[int], answers: int) -> tuple[list[dict[str, Any]], bytes]:
    """``data`` fed to a guarded protocol in reads cut at ``cuts``; the echoes of its requests and
    what it wrote once ``answers`` answers are out."""

    async def run() -> tuple[list[dict[str, Any]], bytes]:
        protocol, transport, _ = _connection()
        app = protocol.app = _RecordingEcho()
        start = 0
        for cut in [*cuts, len(data)]:
            protocol.data_received(data[start:cut])
            start = cut
        for _ in range(10_000):  # (pipelined requests run as tasks, one after the other)
            if transport.written.count(b"HTTP/1.1 ") >= answers:
                break
            await asyncio.sleep(0)
        protocol.connection_lost(None)
        return app.echoes, transport.written

    return asyncio.run(run())


def test_every_cut_of_pipelined_requests_gives_the_same_heads() -> None:
    """Fed directly (the test chooses where each read ends): pipelined proxied requests with
    chunked bodies, trailers and empty lines between them, cut at every byte and at random pairs
    of points: the same scopes as uvicorn's callbacks make of the whole, every request answered."""
    parts = [
        request(head=b"X-A: 1\r\nx-b:  two \t\r\n"),
        chunked(head=b"x-c: 3\r\n", trailers=b"X-T: t\r\n"),
        b"\r\n\r\n",
        chunked(head=b"Expect-Not: 1\r\n"),
        request(head=b"x-d:\r\n", body=b'{"b": "\r\n\r\nx"}'),
    ]
    data = b"".join(parts)
    expected = _expected(data)
    assert len(expected) == 4
    for cut in range(1, len(data)):
        echoes, written = _fed_at_cuts(data, [cut], 4)
        assert echoes == expected, cut
        assert written.count(b"HTTP/1.1 200 OK\r\n") == 4 and b"400" not in written, cut
    rng = random.Random(17)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(data)), 3))
        assert _fed_at_cuts(data, cuts, 4)[0] == expected, cuts


@pytest.mark.parametrize(
    "expect", [b"Expect: 100-continue", b"EXPECT:  100-Continue \t", b"expect:100-CONTINUE"]
)
def test_a_100_continue_in_any_case_is_answered_before_its_body(
    echo_server: ThreadedServer, expect: bytes
) -> None:
    data = request(head=expect + b"\r\n", body=b'{"x": 1}')
    head, body = data.split(b"\r\n\r\n", 1)
    with socket.create_connection(("127.0.0.1", echo_server.port)) as sock:
        sock.settimeout(10)
        sock.sendall(head + b"\r\n\r\n")
        continued = b""
        while not continued.endswith(b"\r\n\r\n"):
            continued += sock.recv(1)
        assert continued == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        (answer,) = read_answers(sock, 1)
    assert json.loads(answer.content) == _expected(data)[0]


def test_unaccounted_bytes_past_the_header_budget_are_not_held(echo_server: ThreadedServer) -> None:
    """A chunk's size line longer than the header budget (its extensions) is refused 400; bytes
    sent after a request that closes the connection (which llhttp ignores) are dropped and its
    answer still goes out whole."""
    budget = EchoApp().state.config.limits.max_header_bytes + HEADER_SLACK_BYTES
    long_line = b"POST %s HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2;x=%s" % (
        PROXIED.encode(),
        b"y" * budget,
    )
    with _send(echo_server, long_line) as sock:
        sock.settimeout(10)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n"), answer[:100]
    closing = request(head=b"connection: close\r\n", body=b'{"z": 1}')
    with _send(echo_server, closing + b"x" * (2 * budget)) as sock:
        (answer,) = read_answers(sock, 1)
        assert answer.status_code == 200 and answer.headers["connection"] == "close"
        assert json.loads(answer.content) == _expected(closing)[0]
        assert sock.recv(65536) == b""
