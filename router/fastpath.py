"""The proxied routes answered inside the HTTP protocol: no ASGI request cycle per request.

``ProxyHttpProtocol`` is uvicorn's httptools protocol that takes the POSTs to the app's
``proxy_paths`` (/v1/chat/completions, /v1/completions) itself: the request becomes a
``ProxyExchange`` instead of uvicorn's ``RequestResponseCycle``, and the app's ``proxy_app`` (the
guarded proxy of router/app.py, the one definition of what the router does with a request) runs
on it directly. Every other request - the control plane: /ready, /metrics, /v1/models, admin,
explain - goes to the ASGI app as before.

What the exchange saves per request, against uvicorn's cycle: the app dispatch, the per-request
``asyncio.Event``, the header regexes and header copies of uvicorn's ``send`` (the router writes its
own headers), and one write per answer (status line, headers and the first body bytes go out in
one ``transport.write``). A client's disconnect comes from the protocol's ``connection_lost`` as a
callback (``disconnect_watcher``), not from a task reading ``receive``.

The exchange is a stand-in for uvicorn's cycle wherever the protocol touches one (``body``,
``more_body``, ``message_event``, ``disconnected``, ``keep_alive``, ``response_complete``,
``run_asgi``), so uvicorn's pipelining and shutdown logic run unchanged for both kinds of request.

Per request, the protocol does only what a request needs (round dp11): the ASGI scope is built
once its headers are in (the proxied kind or uvicorn's own), a proxied request's body bytes are
handed to the exchange without uvicorn's per-chunk checks and copies, and the keep-alive timeout is
one timer per connection that is re-armed only when it fires (uvicorn arms and cancels a timer per
request): ``_idle_since_s`` says since when the connection waits for its next request. Since round
dp17 the parser calls no Python per header line (a request's head is cut from the bytes fed and
parsed in C, ``ProxyHttpProtocol``), the guard's per-request limits run in the same hooks, and a
whole non-stream answer goes out through ``answer_now`` without ``send``'s two awaits.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from itertools import chain
from typing import Any, ClassVar

import httptools
from mypy_extensions import mypyc_attr
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from router.config import LimitsConfig

log = logging.getLogger("kvroute.fastpath")

Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]
ProxyApp = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_SERVER_ERROR = (
    b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 21\r\nconnection: close\r\n\r\nInternal Server Error"
)


#: How long a proxied request's body may take to complete, its headers in, before a task reads it
#: (on the callback path; the task's own limits.body_timeout_s applies from then on).
UPLOAD_GRACE_S = 0.05
#: Graceful stop: how long a connection that has not begun its first request is kept for it.
FIRST_REQUEST_GRACE_S = 0.5

_default_head_of: tuple[object, bytes] = (None, b"")


#: A header line of an answer from its (name, value).
_HEADER_FORMAT = b"%s: %s\r\n".__mod__


def _default_head(default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """uvicorn's default response headers (server, date) as bytes, joined once per list (the
    answer's head reads ``_default_head_of`` first): uvicorn replaces the list when the date
    changes (once a second)."""
    global _default_head_of
    head = b"".join(map(_HEADER_FORMAT, default_headers))
    _default_head_of = (default_headers, head)
    return head


class ProxyExchange:
    """One proxied request on a connection, in the role of uvicorn's ``RequestResponseCycle``:
    ``receive``/``send`` in ASGI form for ``proxy_app``, the response written straight to the
    transport (content-length or chunked framing, keep-alive, flow control)."""

    # The state every exchange starts in (class attributes: an exchange stores only what differs).
    #: The request body received and not taken yet, filled by the protocol's on_body: its first
    #: chunk as it came (bytes), the chunks after it in ``_more`` (joined once, when the body is
    #: taken: one copy of a body that came in many reads, not one per read), ``body_size`` in all.
    body = b""
    _more: list[bytes] | None = None
    body_size = 0
    more_body = True
    disconnected = False
    response_started = False
    response_complete = False
    _waiter: asyncio.Future[None] | None = None
    _on_disconnect: Callable[[], None] | None = None
    _head = b""
    _chunked = False
    #: A stream sent from callbacks (``stream_start``): the answer outlives the request's task.
    _relaying = False
    _on_writable: Callable[[bool], None] | None = None
    #: The answer's headers by name once it started (whose answer it is, for a log line).
    answer_headers: dict[bytes, bytes] | None = None
    #: Why the router cut the connection (router/guard.py, limits.client_write_timeout_s), set
    #: before the disconnect is told; "": the client went away itself.
    cut_reason = ""

    def __init__(
        self, protocol: ProxyHttpProtocol, scope: dict[str, Any], keep_alive: bool, expect_100_continue: bool
    ) -> None:
        self._protocol = protocol
        self.loop = protocol.loop  # the loop it runs on (for the proxy's current_task(loop))
        self.scope = scope
        self.keep_alive = keep_alive
        self.expect_100_continue = expect_100_continue

    # -- uvicorn's side: the protocol calls ``message_event.set()`` on body bytes, the end of the
    # body and a lost connection.
    @property
    def message_event(self) -> ProxyExchange:
        return self

    def set(self) -> None:
        if self.disconnected and self._on_disconnect is not None:
            self._on_disconnect()
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def clear(self) -> None:
        return None

    def is_set(self) -> bool:
        return bool(self.body) or not self.more_body or self.disconnected

    def disconnect_watcher(self, on_disconnect: Callable[[], None] | None) -> bool:
        """Call ``on_disconnect`` when the client's connection is lost before the answer is complete
        (None: stop); True when it is already lost."""
        self._on_disconnect = on_disconnect
        return self.disconnected

    async def run_asgi(self, app: ProxyApp) -> None:
        """Run ``app`` (the guarded proxy) on this exchange, as uvicorn runs an ASGI app on a cycle:
        a 500 when it fails before answering, the connection closed when it stops mid-answer."""
        try:
            await app(self.scope, self.receive, self.send)
        except BaseException as exc:
            log.error("exception in the proxy", exc_info=exc)
            transport = self._protocol.transport
            if not self.response_started and not self.disconnected:
                self.response_complete = True
                transport.write(_SERVER_ERROR)
            transport.close()
            if isinstance(exc, asyncio.CancelledError):
                raise
        else:
            if not self.response_complete and not self.disconnected and not self._relaying:
                # Stopped mid-answer (a stream that broke off): whatever was sent goes out, then the
                # connection closes, so no client takes the answer for complete.
                transport = self._protocol.transport
                if self._head:
                    transport.write(self._head)
                    self._head = b""
                if not self.response_started:
                    log.error("the proxy returned without an answer")
                    transport.write(_SERVER_ERROR)
                transport.close()
        finally:
            if not self._relaying:  # (a stream relayed from callbacks watches on)
                self._on_disconnect = None

    def complete_body(self) -> bytes | None:
        """The whole request body when it is all in (nothing to wait for, no 100 Continue owed,
        the client still there), taken as ``receive`` would; else None: use ``receive``."""
        if self.more_body or self.expect_100_continue or self.disconnected or self.response_complete:
            return None
        return self._take_body()

    def add_chunk(self, chunk: bytes) -> int:
        """A chunk of the request body after its first (the protocol's ``on_body`` holds a first
        one itself), kept as it came; the size held now."""
        more = self._more
        if more is None:
            self._more = [chunk]
        else:
            more.append(chunk)
        size = self.body_size = self.body_size + len(chunk)
        return size

    def _take_body(self) -> bytes:
        """The body received so far, taken: the one chunk as it came, or the chunks joined."""
        body, more = self.body, self._more
        self.body, self.body_size = b"", 0
        if more is None:
            return body
        self._more = None
        more.insert(0, body)
        return b"".join(more)

    # -- the ASGI side
    async def receive(self) -> dict[str, Any]:
        if self.expect_100_continue:
            self.expect_100_continue = False
            if not self._protocol.transport.is_closing():
                self._protocol.transport.write(_CONTINUE)
        while not self.body and self.more_body and not self.disconnected and not self.response_complete:
            self._protocol.flow.resume_reading()
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            await waiter
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": self._take_body(), "more_body": self.more_body}

    async def send(self, message: dict[str, Any]) -> None:
        protocol = self._protocol
        if protocol.flow.write_paused and not self.disconnected:
            await protocol.flow.drain()
        if self.disconnected:
            return
        if not self.response_started:
            if message["type"] != "http.response.start":
                raise RuntimeError(f"expected 'http.response.start', got {message['type']!r}")
            self.response_started = True
            self.expect_100_continue = False
            self._start(message["status"], message.get("headers") or ())
            return
        if self.response_complete:
            raise RuntimeError(f"{message['type']!r} sent after the response was complete")
        if message["type"] != "http.response.body":
            raise RuntimeError(f"expected 'http.response.body', got {message['type']!r}")
        self._write_body(message.get("body", b""), message.get("more_body", False))

    def _write_body(self, body: bytes, more_body: bool) -> None:
        """Body bytes in the answer's framing (content-length or chunked), after the head when it
        has not gone out yet; the end of the answer unless ``more_body``."""
        protocol = self._protocol
        if self._chunked:
            parts = [self._head, b"%x\r\n" % len(body), body, b"\r\n"] if body else [self._head]
            if not more_body:
                parts.append(b"0\r\n\r\n")
            data = b"".join(parts)
        else:
            data = self._head + body if self._head else body
        self._head = b""
        if data:
            protocol.transport.write(data)
        if not more_body:
            self.response_complete = True
            if not self.keep_alive:
                protocol.transport.close()
            protocol.on_response_complete()

    # -- a streamed answer sent from callbacks (the callback path's stream relay,
    # router/routing.py's ``_CallbackStream``): no task, no await per piece.
    def stream_start(self, headers: list[tuple[bytes, bytes]]) -> None:
        """Status 200 and ``headers`` (chunked framing), kept to go out with the first bytes; the
        request's task may end before the answer does."""
        self.response_started = True
        self.expect_100_continue = False
        self._relaying = True
        self._start(200, headers)

    def stream_write(self, data: bytes) -> None:
        if not self.disconnected:
            self._write_body(data, True)

    def stream_end(self, data: bytes) -> None:
        if not self.disconnected:
            self._write_body(data, False)

    def stream_now(self, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A whole streamed answer at once (the engine's stream was complete when its relay
        began): status 200, ``headers`` (chunked framing), ``body`` and the final chunk in one
        write, without ``send``'s awaits and messages (``answer_now``'s stream); nothing when the
        client is gone."""
        if self.disconnected or self.response_started:
            return
        self.response_started = True
        self.expect_100_continue = False
        self._start(200, headers)
        self._write_body(body, False)

    def stream_abort(self, data: bytes) -> None:
        """``data`` (and the head if it has not gone out), then the connection closed with the
        answer unfinished: no client takes it for complete."""
        if not self.disconnected:
            self._write_body(data, True)
        self._protocol.transport.close()

    def cut(self, reason: str) -> bool:
        """The router aborts the connection for ``reason`` (router/guard.py): True when the request
        is still being answered (who watches its disconnect finishes it with ``cut_reason``), False
        when its answer was complete or nobody watches."""
        if self.response_complete or self.disconnected or self._on_disconnect is None:
            return False
        self.cut_reason = reason
        return True

    def writable_watcher(self, on_writable: Callable[[bool], None] | None) -> bool:
        """Call ``on_writable(False)`` when the client's transport pauses writing (its buffer over
        the high-water mark) and ``on_writable(True)`` when it resumes (None: stop); whether it
        is writable now."""
        self._on_writable = on_writable
        return not self._protocol.flow.write_paused

    def answer_now(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A complete answer written at once, without ``send``'s awaits (the callback path): what
        its two messages would write, in one write."""
        if self.disconnected or self.response_started:
            return
        self.response_started = True
        self.expect_100_continue = False
        headers.append((b"content-length", b"%d" % len(body)))
        self._start(status, headers)
        head, self._head = self._head, b""
        protocol = self._protocol
        protocol.transport.write(head + body)
        self.response_complete = True
        if not self.keep_alive:
            protocol.transport.close()
        protocol.on_response_complete()

    def run_as_task(self, app: ProxyApp) -> None:
        """Run ``app`` on this exchange as a task, as the protocol starts a proxied request (the
        callback path handing a request over)."""
        self._protocol._start_asgi_task(self, app)  # type: ignore[arg-type]

    def _start(self, status: int, headers: Any) -> None:
        """The status line and headers, kept to go out with the first body bytes (one write)."""
        if type(headers) is not list:
            headers = list(headers)
        names = self.answer_headers = dict(headers)  # which there are (lines joined in C below)
        chunked = b"content-length" not in names
        if b"connection" in names and any(
            name == b"connection" and b"close" in value.lower() for name, value in headers
        ):
            self.keep_alive = False
        self._chunked = chunked
        default_headers = self._protocol.server_state.default_headers
        source, default_head = _default_head_of
        if source is not default_headers:
            default_head = _default_head(default_headers)
        self._head = b"".join(
            (
                STATUS_LINE[status],
                default_head,
                b"".join(map(_HEADER_FORMAT, headers)),
                b"transfer-encoding: chunked\r\n" if chunked else b"",
                b"" if self.keep_alive else b"connection: close\r\n",
                b"\r\n",
            )
        )


#: uvicorn's test for a 100-continue request: a header ``expect`` whose value is ``100-continue``.
_EXPECT_100 = re.compile(rb"\r\nexpect:[ \t]*100-continue[ \t]*\r\n", re.IGNORECASE)
#: A request's head as llhttp has framed it: any empty lines before the request line (which it
#: skips), the request line (its target: group 1); its header lines follow, from the CRLF that ends
#: the request line to the CRLF before the blank line (``_BLANK_LINE``). Two steps, not one pattern
#: over the header lines too: SRE's repeated group costs more than the search (measured: 0.8
#: against 0.4-0.5 µs a three-line head, on a PGO+LTO CPython).
_REQUEST_LINE = re.compile(rb"[\r\n]*[^ ]+ +([^ \r\n]+)[^\r\n]*")
_BLANK_LINE = re.compile(rb"\r\n\r\n")

#: The guard's limits when ``limits`` sets none (router/guard.py's protocol sets them from the config).
_LIMITS = LimitsConfig()

#: Request-line and header bytes a connection may send beyond ``max_header_bytes`` before the exact
#: count (taken when the headers are complete) can be made: the request line and the CRLFs.
HEADER_SLACK_BYTES = 1024

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


def header_lines(head: bytes | bytearray | memoryview, start: int, end: int) -> list[tuple[bytes, bytes]]:
    """The header lines of ``head[start:end]`` (from the CRLF before the first line to the CRLF
    after the last) as ASGI wants them: lower-case names, values without the spaces and tabs around
    them, as llhttp and uvicorn's ``on_header`` give them. llhttp has validated the lines before
    this runs (a token, a colon, a value of visible bytes, spaces and tabs, CRLF; it refuses line
    folding and a bare CR or LF: tests/test_request_heads.py). The lines are split in C and walked
    in Python: a regular expression over them cost 3x as much (1.9 against 0.6 µs a three-line
    head, on a PGO+LTO CPython)."""
    if end - start <= 2:  # no header line
        return []
    pairs = []
    for line in bytes(head[start + 2 : end - 2]).split(b"\r\n"):
        name, _, value = line.partition(b":")
        pairs.append((name.lower(), value.strip(b" \t")))
    return pairs


# router/guard.py subclasses it; when mypyc compiles this module (tools/mypyc_build.py) a compiled
# class refuses interpreted subclasses unless told otherwise.
@mypyc_attr(allow_interpreted_subclasses=True)
class ProxyHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol answering the app's proxied routes with a ``ProxyExchange``
    (see the module's docstring); every other request goes through the ASGI app as before.

    It also runs the guard's per-request limits (router/guard.py's protocol, a subclass, sets them
    and adds the connection cap and the client write timeout): header bytes fed only up to
    ``max_header_bytes`` plus a slack while a request's headers are incomplete, at most
    ``max_headers`` lines, the header timeout armed while a request's headers are incomplete, and
    the waiting/uploading tables of the connection cap kept per request (one hook per parser event,
    not one per layer).

    Header lines cost no Python call each: the parser has no ``on_header`` nor ``on_url``; a
    request's head is cut from the bytes fed at its ``on_headers_complete`` (llhttp still frames and
    validates it) and parsed in C (``header_lines``). To know where a head begins, the callbacks
    account for every byte fed (``_fed``, ``_at``): a head ends at its blank line, a body's bytes
    come through ``on_body``, a chunked body's framing through ``on_chunk_header`` and
    ``on_chunk_complete``; bytes not accounted for when a read ends (a head or a chunk's framing
    cut by the read's end) lead the next read (``_carry``)."""

    on_header = None  # type: ignore[assignment]
    on_url = None  # type: ignore[assignment]

    header_timeout_s = _LIMITS.header_timeout_s
    max_header_bytes = _LIMITS.max_header_bytes
    max_headers = _LIMITS.max_headers
    # Shared by the connections of one server, oldest first (dicts keep insertion order): those
    # waiting for a request or its headers, and those uploading a request's body.
    waiting: ClassVar[dict[Any, None]] = {}
    uploading: ClassVar[dict[Any, None]] = {}

    #: A proxied request not started yet, and its app: with the app's ``proxy_now``
    #: (proxy.callback_path), a request is answered in callbacks once its body is complete at the
    #: end of a chunk, and run as a task otherwise (``_start_deferred``).
    _deferred: tuple[ProxyExchange, ProxyApp] | None = None
    _upload_timer: asyncio.TimerHandle | None = None
    #: The request being received when it is a proxied one (its body goes to the exchange).
    _exchange: ProxyExchange | None = None
    #: The loop time since which the connection has waited for its next request after an answer
    #: (0: it has not, or bytes came since): the keep-alive timeout counts from there.
    _idle_since_s = 0.0
    #: The bytes being parsed (a read, led by the carry), how far the callbacks account for them,
    #: and the bytes of earlier reads not accounted for yet.
    _fed: bytes | bytearray | memoryview = b""
    _at = 0
    _carry: bytearray | None = None
    #: Header bytes fed for the request whose headers are incomplete; requests begun and those whose
    #: headers were complete (pipelining); whether the connection waits for or receives headers.
    _header_bytes = 0
    _heads_begun = 0
    _heads_done = 0
    _in_headers = True
    _answered_one = False
    _shutdown_deferred = False
    _header_timer: asyncio.TimerHandle | None = None
    #: Since when the connection waits (for its request or its body): the connection cap's order.
    _waiting_since_s = 0.0

    def data_received(self, data: bytes | bytearray | memoryview) -> None:  # type: ignore[override]
        transport = self.transport
        if transport.is_closing():
            return
        in_headers = self._in_headers
        rest: bytes | bytearray | memoryview = b""
        if in_headers:
            # Feed header bytes only up to the limit: the parser holds an unfinished header line
            # in memory, so everything past the budget is refused unread. A read that also holds
            # the end of the headers and a body goes on in a second feed.
            budget = self.max_header_bytes + HEADER_SLACK_BYTES - self._header_bytes
            cut = budget
            if len(data) > budget:
                # A read longer than the budget (a large body with its headers) is cut where the
                # headers end when that is within the budget, so that the body reaches the parser
                # in one piece (one on_body: the exchange holds it as it came, with no join of
                # two), and cut through a memoryview (no copy of either side).
                end = data.find(b"\r\n\r\n", 0, budget) if type(data) is bytes else -1
                if end >= 0:
                    cut = end + 4
                data = memoryview(data)
                data, rest = data[:cut], data[cut:]
            heads_before = self._heads_done
        # The parser; bytes mark the connection busy (the keep-alive timer stays armed:
        # ``_keep_alive_due``).
        self._idle_since_s = 0.0
        carry = self._carry
        if carry is None:
            self._fed = data
        else:
            carry += data  # (the parser has had the carry's bytes: it gets the read's)
            self._fed = carry
        self._at = 0
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        fed = self._fed
        self._fed = b""
        if self._at < len(fed):
            at = self._at
            # A head or a chunk's framing cut by the read's end: it leads the next read.
            if carry is not None and fed is carry:
                del carry[:at]
            else:
                self._carry = carry = bytearray(fed[at:])
            if not self._in_headers and len(carry) > self.max_header_bytes + HEADER_SLACK_BYTES:
                # Nothing that long is left unaccounted for in a request (a head is refused at the
                # budget, 431, below): bytes after a request that closes the connection, which the
                # parser ignores (dropped: its answer goes out, then the connection closes), or a
                # chunk's framing past any sane size (refused, 400). Not held either way.
                self._carry = None
                if getattr(self.cycle, "keep_alive", True) and not transport.is_closing():
                    self.send_400_response("Invalid HTTP request received.")
        elif carry is not None:
            self._carry = None
        if self._deferred is not None:
            self._go_on_deferred()
        if transport.is_closing():
            return
        if in_headers and self._in_headers:
            if self._heads_done != heads_before:
                # A request's headers ended in this read and a pipelined one's began: the bytes
                # before it were not its headers. The rest of the read goes on with a budget of
                # its own (the new request's first bytes go uncounted: one read at most;
                # on_headers_complete checks the exact size).
                if rest:
                    self.data_received(rest)
                elif self._heads_begun != self._heads_done:
                    self._start_header_timer()  # (not when it waits for the next request)
                return
            self._header_bytes += len(data)
            if rest and cut < budget:
                # Cut early at a blank line that did not end the headers (empty lines before a
                # request line): the rest of the read goes on, within the budget.
                self.data_received(rest)
            elif rest or self._header_bytes >= self.max_header_bytes + HEADER_SLACK_BYTES:
                self._reject(431, b"request headers exceed limits.max_header_bytes")
            elif self._header_bytes:
                # A request's headers began and are not complete: they have the header timeout
                # from now on (armed here, not per request in on_message_begin: a request whose
                # headers come whole needs no timer).
                self._start_header_timer()
            return
        if rest:
            self.data_received(rest)  # (its headers complete: the body, fed as it is)
        elif not in_headers and self._heads_begun != self._heads_done:
            self._start_header_timer()  # a pipelined request's headers began in this read

    def _go_on_deferred(self) -> None:
        """The callback path, once a read is parsed: the deferred request answered in callbacks
        when its body is complete, else given ``UPLOAD_GRACE_S`` or a task."""
        deferred = self._deferred
        if deferred is None:
            return
        exchange, _ = deferred
        if exchange.more_body:
            # The body comes in more chunks (a client writing its headers and body apart): it
            # has UPLOAD_GRACE_S to complete, then a task reads it under limits.body_timeout_s.
            # A body past uvicorn's high-water mark (reading paused) or owed a 100 Continue goes
            # to the task at once.
            if self.flow.read_paused or exchange.expect_100_continue or exchange.disconnected:
                self._start_deferred()
            elif self._upload_timer is None:
                self._upload_timer = self.loop.call_later(UPLOAD_GRACE_S, self._start_deferred)
            return
        self._deferred = None
        if self._upload_timer is not None:
            self._upload_timer.cancel()
            self._upload_timer = None
        if not exchange.expect_100_continue and not exchange.disconnected:
            try:
                if self.app.proxy_now(exchange):
                    return
            except Exception as exc:
                log.error("exception in the proxy's callback path", exc_info=exc)
                if not exchange.response_started and not exchange.disconnected:
                    exchange.response_complete = True
                    self.transport.write(_SERVER_ERROR)
                self.transport.close()
                return
        self._start_asgi_task(exchange, deferred[1])  # type: ignore[arg-type]

    def _start_deferred(self) -> None:
        """The deferred request goes on as a task (``proxy_app``), as without the callback path."""
        if self._upload_timer is not None:
            self._upload_timer.cancel()
            self._upload_timer = None
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            self._start_asgi_task(deferred[0], deferred[1])  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        self.waiting.pop(self, None)
        self.uploading.pop(self, None)
        super().connection_lost(exc)
        # A request cut off during its upload: its task sees the disconnect and counts it.
        self._start_deferred()

    def shutdown(self) -> None:
        """uvicorn's graceful stop for this connection (its answer finishes, then it closes; an
        idle one closes now), except that a connection that has not begun a request yet gets
        FIRST_REQUEST_GRACE_S for its first one: it may have been accepted in the last turns with
        its request already sent (router/listener.py makes a connection a turn or two after it
        accepts it), and closing it unread would fail that request with a read error instead of
        answering it (with ``connection: close``)."""
        if self.cycle is None and not self._shutdown_deferred and not self.transport.is_closing():
            self._shutdown_deferred = True
            self.loop.call_later(FIRST_REQUEST_GRACE_S, self.shutdown)
            return
        super().shutdown()

    def on_message_begin(self) -> None:
        # uvicorn's sets the url, headers and scope: here they are made from the head once it is
        # complete (``on_headers_complete``).
        self._in_headers = True
        self._heads_begun += 1

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._heads_done += 1
        if self._header_timer is not None:
            self._stop_header_timer()
        self.waiting.pop(self, None)
        self.uploading[self] = None
        self._waiting_since_s = self.loop.time()
        self._header_bytes = 0
        # The head, from the bytes fed (after any empty lines before the request line, which the
        # parser skips) to its blank line.
        fed = self._fed
        request_line = _REQUEST_LINE.match(fed, self._at)
        blank = _BLANK_LINE.search(fed, request_line.end()) if request_line is not None else None
        if request_line is None or blank is None:
            raise ValueError("no request head where the bytes fed say one begins")  # (a 400)
        start, end = request_line.end(), blank.start() + 2
        self._at = end + 2
        url = self.url = request_line[1]
        headers = self.headers = header_lines(fed, start, end)
        self.expect_100_continue = _EXPECT_100.search(fed, start, end) is not None
        # The guard's limits: uvicorn keeps every header line; each line's name, value and ": " +
        # CRLF count (at most the head's length plus one a line: the exact sum only near it).
        lines = len(headers)
        if lines > self.max_headers or end - request_line.start() + lines > self.max_header_bytes:
            too_many = lines > self.max_headers
            if too_many or sum(map(len, chain.from_iterable(headers))) + 4 * len(headers) + len(url) > (
                self.max_header_bytes
            ):
                self._refuse_headers(b"header lines" if too_many else b"header bytes")
                return
        app = self.app
        proxy_app = getattr(app, "proxy_app", None)
        parser = self.parser
        if (
            proxy_app is None
            or parser.get_method() != b"POST"
            or self.limit_concurrency is not None
            or parser.should_upgrade()
        ):
            self.asgi_headers_complete()
            return
        path = app.proxy_paths.get(url)  # the usual request line: the path alone, no query
        if path is not None:
            raw_path, query = url, b""
        else:
            # Any: httptools types ``query`` as bytes but gives None without a query (compiled,
            # the declared type would be checked on read).
            parsed: Any = httptools.parse_url(url)
            raw_path, query = parsed.path, parsed.query or b""
            path = app.proxy_paths.get(raw_path)
            if path is None:
                self.asgi_headers_complete()
                return
        http_version = parser.get_http_version()
        scope = self.scope = self._scope(http_version, "POST", path, raw_path, query)  # type: ignore[assignment]
        exchange = self._exchange = ProxyExchange(
            self,
            scope,
            # (after a graceful stop began: the connection's last request)
            http_version != "1.0" and parser.should_keep_alive() and not self._shutdown_deferred,
            self.expect_100_continue,
        )
        existing = self.cycle
        self.cycle = exchange  # type: ignore[assignment]
        if existing is None or existing.response_complete:
            if getattr(app, "proxy_now", None) is not None and len(app.callback_busy) < app.callback_below:
                # The callback path: decided once this chunk is parsed (``data_received``).
                self._deferred = (exchange, proxy_app)
            else:
                self._start_asgi_task(exchange, proxy_app)  # type: ignore[arg-type]
        else:
            # Pipelined behind an answer still going out: uvicorn starts it when that one is done.
            self.flow.pause_reading()
            self.pipeline.appendleft((exchange, proxy_app))  # type: ignore[arg-type]

    def _refuse_headers(self, what: bytes) -> None:
        """A request over the guard's header limits, answered 431 through uvicorn's own request
        cycle (it keeps parsing any body that follows) with an app that refuses: the same way it
        answers over limit_concurrency."""
        app, self.app = self.app, _headers_too_large(what)
        try:
            self.asgi_headers_complete()
        finally:
            self.app = app

    def asgi_headers_complete(self) -> None:
        """The request whose headers are in goes to the ASGI app (``self.app``) as uvicorn runs it:
        its scope as uvicorn's ``on_message_begin`` builds it, then uvicorn's request cycle."""
        self._exchange = None
        # (uvicorn sets the version, method, path and query)
        self.scope = self._scope("1.1", "", "", b"", b"")  # type: ignore[assignment]
        HttpToolsProtocol.on_headers_complete(self)
        if self._shutdown_deferred and self.cycle is not None:
            self.cycle.keep_alive = False  # the graceful stop began: the last request here

    def _scope(
        self, http_version: str, method: str, path: str, raw_path: bytes, query: bytes
    ) -> dict[str, Any]:
        """A request's ASGI scope: the keys uvicorn's ``on_message_begin`` fills in, and those of
        its ``on_headers_complete``."""
        return {
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": http_version,
            "method": method,
            "path": path,
            "raw_path": raw_path,
            "query_string": query,
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
        }

    def on_body(self, body: bytes) -> None:
        self._at += len(body)
        exchange = self._exchange
        if exchange is None:
            HttpToolsProtocol.on_body(self, body)
            return
        # A proxied request never upgrades (on_headers_complete): uvicorn's on_body without that check.
        if exchange.response_complete:
            return
        if not exchange.body:  # the usual case, the whole body in one chunk: held as it came
            exchange.body = body
            size = exchange.body_size = len(body)
        else:
            size = exchange.add_chunk(body)
        if size > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        if exchange._waiter is not None:
            exchange.set()

    # A chunked body's framing, accounted for (a head after it is found from there): the size line
    # (with any extensions) before a chunk's bytes, the CRLF after them; the last chunk's size line,
    # then its trailer lines (uvicorn adds them to the request's headers) and a blank line.
    def on_chunk_header(self) -> None:
        fed, at = self._fed_from_at()
        self._at = fed.index(b"\n", at) + 1

    def on_chunk_complete(self) -> None:
        fed, at = self._fed_from_at()
        if fed.startswith(b"\r\n", at):
            self._at = at + 2
            return
        end = self._at = fed.index(b"\r\n\r\n", at) + 4
        headers = self.headers
        if headers is not None:
            headers.extend(header_lines(b"\r\n" + fed[at:end], 0, end - at))  # (up to the blank line)

    def _fed_from_at(self) -> tuple[bytes, int]:
        """The bytes fed as bytes (from the accounted-for position when they were not), and that
        position."""
        fed, at = self._fed, self._at
        if type(fed) is bytes:
            return fed, at
        self._fed = fed = bytes(fed[at:])
        self._at = 0
        return fed, 0

    def on_message_complete(self) -> None:
        self.uploading.pop(self, None)  # the request is complete: active until answered
        exchange = self._exchange
        if exchange is None:
            HttpToolsProtocol.on_message_complete(self)
            return
        if not exchange.response_complete:
            exchange.more_body = False
            if exchange._waiter is not None:
                exchange.set()

    def on_response_complete(self) -> None:
        # uvicorn's, with the keep-alive timer armed only when none is (``_keep_alive_due``), and
        # the connection waiting for its next request (the guard's tables).
        self.server_state.total_requests += 1
        self._header_bytes = 0
        self.uploading.pop(self, None)
        self._answered_one = True
        if self.transport.is_closing():
            return
        self._in_headers = True  # waiting for the next request on this connection
        self.waiting[self] = None
        flow = self.flow
        if flow.read_paused:
            flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            self._waiting_since_s = self.loop.time()  # (for a pipelined request)
            return
        self._waiting_since_s = self._idle_since_s = now = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_at(
                now + self.timeout_keep_alive, self._keep_alive_due
            )

    def pause_writing(self) -> None:
        self.flow.pause_writing()
        self._tell_writable(False)

    def resume_writing(self) -> None:
        self.flow.resume_writing()
        self._tell_writable(True)

    def _tell_writable(self, writable: bool) -> None:
        on_writable = getattr(self.cycle, "_on_writable", None)  # (a relayed stream's)
        if on_writable is not None:
            on_writable(writable)

    def _keep_alive_due(self) -> None:
        """The keep-alive timer: the connection is closed when it has waited for its next request
        for ``timeout_keep_alive`` (uvicorn's timeout), else the timer is armed for the rest of
        that wait; a connection that is busy gets it again after its answer."""
        self.timeout_keep_alive_task = None
        idle_since_s = self._idle_since_s
        if not idle_since_s or self.transport.is_closing():
            return
        due_s = idle_since_s + self.timeout_keep_alive
        if self.loop.time() >= due_s:
            self.timeout_keep_alive_handler()
        else:
            self.timeout_keep_alive_task = self.loop.call_at(due_s, self._keep_alive_due)

    # -- the header timeout (limits.header_timeout_s): one timer, armed only while a request's
    # headers are incomplete.
    def _start_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._in_headers and not self.transport.is_closing():
            self._reject(408, b"request headers not received within limits.header_timeout_s")

    def _reject(self, status: int, message: bytes) -> None:
        """Answer ``status`` with ``message`` and close, before any request is read."""
        self._stop_header_timer()
        self.waiting.pop(self, None)
        self.uploading.pop(self, None)
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%s" % (status, _REASONS[status], len(message), message)
        )
        self.transport.close()


def _headers_too_large(what: bytes) -> Any:
    """An ASGI app answering 431 and closing the connection."""
    body = b"too many request " + what

    async def app(scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(body))]
        await send(
            {"type": "http.response.start", "status": 431, "headers": [*headers, (b"connection", b"close")]}
        )
        await send({"type": "http.response.body", "body": body})

    return app
