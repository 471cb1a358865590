"""The guard's header budget with pipelined requests (router/guard.py): only a request's own header
bytes count against ``limits.max_header_bytes``, wherever in a read it begins.

The protocol is fed whole reads directly (``data_received``) so that where a read ends is the
test's choice: over a socket the kernel decides how two pipelined requests are cut, which is what
made this bug depend on timing. The app answers on the callback path, as ``proxy_now`` does, at
once; uvicorn's own protocol code, the guard and the exchange are the real ones."""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from router.config import load_config
from router.fastpath import HEADER_SLACK_BYTES
from router.guard import guarded_http_protocol

ANSWER = b'{"ok": true}'


class Transport:
    """What the protocol writes, and whether it closed the connection."""

    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    abort = close

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(name, default)


class AnswerAtOnce:
    """The app's side of the callback path: every proxied request answered 200 in the callback."""

    proxy_paths = {b"/v1/chat/completions": "/v1/chat/completions"}
    callback_busy = ()  # (as KvrouteApp's with proxy.callback_path true: never busy)
    callback_below = 1

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    def proxy_now(self, exchange: Any) -> bool:
        self.bodies.append(exchange.complete_body())
        exchange.answer_now(200, [(b"content-type", b"application/json")], ANSWER)
        return True

    async def proxy_app(self, scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("every request here is answered on the callback path")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("no control-plane request here")


def chat(body_bytes: int) -> bytes:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "%s"}]}' % (b"x" * body_bytes)
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )


def _connection() -> tuple[Any, Transport, AnswerAtOnce]:
    config = load_config(
        environ={}, overrides={"engines": [{"id": "e0", "url": "http://127.0.0.1:9", "model": "m"}]}
    )
    app = AnswerAtOnce()
    server_config = uvicorn.Config(
        app, proxy_headers=False, lifespan="off", log_level="warning", access_log=False
    )
    server_config.load()
    protocol_class = guarded_http_protocol(config.limits)
    protocol = protocol_class(
        config=server_config, server_state=ServerState(), app_state={}, _loop=asyncio.get_running_loop()
    )
    transport = Transport()
    protocol.connection_made(transport)
    return protocol, transport, app


async def test_a_pipelined_request_whose_headers_straddle_the_budget_is_answered() -> None:
    """A read of one large request and the start of a small one, the header budget (max header bytes
    + slack, from the read's start) ending inside the small one's header lines: both are answered.
    Before the fix the guard counted the large request's body as the small one's header bytes and
    answered 431, closing the connection and losing the first answer."""
    protocol, transport, app = _connection()
    budget = protocol.max_header_bytes + HEADER_SLACK_BYTES
    second = chat(10)
    first = chat(budget - 40 - len(chat(0)))
    assert len(first) < budget < len(first) + second.index(b"\r\n\r\n")  # the budget ends in its headers
    protocol.data_received(first + second[:60])
    protocol.data_received(second[60:])
    assert transport.written.count(b"HTTP/1.1 200 OK") == 2, transport.written[:200]
    assert b"431" not in transport.written and not transport.closed
    assert len(app.bodies) == 2
    protocol.connection_lost(None)


async def test_a_request_answered_in_its_own_read_leaves_the_next_one_its_whole_budget() -> None:
    """A large request answered inside its read leaves the connection waiting: the next request's
    header bytes are its own only (before the fix the large read was counted against it, so a next
    request with headers over what was left was refused 431), and no header timer runs while the
    connection waits for it."""
    protocol, transport, _ = _connection()
    protocol.data_received(chat(30_000))
    assert protocol._header_timer is None  # waiting for a request that has not begun: no timer
    big_headers = b"".join(b"x-pad-%d: %s\r\n" % (i, b"v" * 90) for i in range(60))  # ~6 KB of headers
    second = chat(10).replace(b"host: 127.0.0.1\r\n", b"host: 127.0.0.1\r\n" + big_headers)
    protocol.data_received(second)
    assert transport.written.count(b"HTTP/1.1 200 OK") == 2, transport.written[-300:]
    assert not transport.closed
    protocol.connection_lost(None)


class RecordingPieces(AnswerAtOnce):
    """Also records in how many pieces the exchange held the body when it was complete (1: as the
    parser gave it, in one piece)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[type] = []

    def proxy_now(self, exchange: Any) -> bool:
        self.held.append(1 + len(exchange._more or ()))
        return super().proxy_now(exchange)


def _recording_connection() -> tuple[Any, Transport, RecordingPieces]:
    protocol, transport, _ = _connection()
    app = RecordingPieces()
    protocol.app = app
    return protocol, transport, app


def _body_of(request: bytes) -> bytes:
    return request.split(b"\r\n\r\n", 1)[1]


async def test_a_body_larger_than_the_header_budget_reaches_the_exchange_in_one_piece() -> None:
    """A 16K-token request (a body longer than the header budget) in one read: the guard cuts the
    read where the headers end, so the parser hands the whole body over at once (the exchange
    holds it as it came, not joined from two pieces), byte for byte."""
    protocol, transport, app = _recording_connection()
    budget = protocol.max_header_bytes + HEADER_SLACK_BYTES
    request = chat(2 * budget)
    protocol.data_received(request)
    assert transport.written.count(b"HTTP/1.1 200 OK") == 1 and not transport.closed
    assert app.bodies == [_body_of(request)]
    assert app.held == [1]
    protocol.connection_lost(None)


async def test_a_large_request_cut_anywhere_gets_the_same_body_and_answer() -> None:
    """The same large request in two reads cut at every place where the guard's cut could matter
    (in the request line, inside the blank line that ends the headers, right after it, in the
    body, at the budget), after blank lines before its request line, and with the next request's
    start in the same read: every body arrives whole and every request is answered."""
    budget = _connection()[0].max_header_bytes + HEADER_SLACK_BYTES
    request = chat(2 * budget)
    end = request.index(b"\r\n\r\n")
    for cut in (5, end, end + 1, end + 2, end + 3, end + 4, end + 100, budget - 1, budget, budget + 1):
        protocol, transport, app = _recording_connection()
        protocol.data_received(request[:cut])
        protocol.data_received(request[cut:])
        assert transport.written.count(b"HTTP/1.1 200 OK") == 1, (cut, transport.written[:200])
        assert app.bodies == [_body_of(request)] and not transport.closed, cut
        protocol.connection_lost(None)
    protocol, transport, app = _recording_connection()
    protocol.data_received(b"\r\n\r\n" + request)
    protocol.data_received(request + chat(10)[:30])
    protocol.data_received(chat(10)[30:])
    assert transport.written.count(b"HTTP/1.1 200 OK") == 3, transport.written[-200:]
    assert app.bodies == [_body_of(request), _body_of(request), _body_of(chat(10))]
    assert not transport.closed
    protocol.connection_lost(None)


async def test_a_body_in_many_reads_is_held_as_its_pieces_and_taken_whole() -> None:
    """A body that comes in many reads (a client writing it in 1 KB pieces): the exchange keeps
    each piece as the parser gave it and joins them once, when the body is taken, and the body
    is whole, byte for byte. Catches: pieces lost or joined out of order, or a copy per read
    again (a bytearray grown read by read: one piece)."""
    protocol, transport, app = _recording_connection()
    request = chat(40_000)
    for at in range(0, len(request), 1000):
        protocol.data_received(request[at : at + 1000])
    assert transport.written.count(b"HTTP/1.1 200 OK") == 1 and not transport.closed
    assert app.bodies == [_body_of(request)]
    assert app.held[0] > 30
    protocol.connection_lost(None)


async def test_a_large_read_whose_headers_do_not_end_within_the_budget_is_refused() -> None:
    """The cut at the headers' end is only taken within the budget: header lines longer than the
    budget in one large read are still refused (431) without being fed to the parser."""
    protocol, transport, app = _recording_connection()
    budget = protocol.max_header_bytes + HEADER_SLACK_BYTES
    pad = b"x-pad: %s\r\n" % (b"v" * budget)
    protocol.data_received(chat(budget).replace(b"host: 127.0.0.1\r\n", b"host: 127.0.0.1\r\n" + pad))
    assert transport.written.startswith(b"HTTP/1.1 431 ") and transport.closed
    assert app.bodies == []
    protocol.connection_lost(None)
