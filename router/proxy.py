"""The one upstream HTTP client of the router: a keep-alive pool of raw connections to every engine.

``UpstreamClient.send`` posts the original body bytes on a pooled HTTP/1.1 connection (an asyncio
protocol with httptools parsing only the answer's framing) and returns the open ``UpstreamResponse``
once its headers are in, so the caller can relay the body as it arrives; failures are classified
into ``UpstreamConnectError`` (refused, or the connection broke before any byte of an answer: safe
to retry elsewhere), ``UpstreamFirstByteTimeout`` and ``UpstreamTimeout`` (the engine sent nothing
for the read timeout). The first-byte and read deadlines of every exchange are checked by one
periodic timer (``UpstreamClient._tick``, every ``DEADLINE_TICK_S`` while exchanges run), not a
timeout object per request. aiohttp was measured at about a quarter of the router's CPU per
request (docs/benchmarks.md, B3); it remains the client of the health poller, tokenizer and
scrapes (``UpstreamClient.session``), where requests are rare.
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Set
from typing import TypeAlias
from urllib.parse import urlsplit

import aiohttp
import httptools

log = logging.getLogger("kvroute.proxy")

#: How often the deadlines of running exchanges are checked (their resolution).
DEADLINE_TICK_S = 0.05

# Headers of the client's request worth forwarding to an engine (auth, tracing, session hints);
# everything else (host, content-length, hop-by-hop) is the router's own business.
FORWARDED_REQUEST_HEADERS = ("authorization", "x-session-id", "x-correlation-id", "traceparent", "tracestate")


class UpstreamError(Exception):
    """Base of the failures to reach or read an engine."""

    kind = "error"


class UpstreamConnectError(UpstreamError):
    """The engine refused or dropped the connection before answering: retry on a fallback."""

    kind = "connect"


class UpstreamTimeout(UpstreamError):
    """The engine did not answer within the configured timeout."""

    kind = "timeout"


class UpstreamFirstByteTimeout(UpstreamConnectError):
    """No first byte of an answer within the request's time-to-first-byte budget (a hung or
    stopped engine): nothing reached the client, so it may go elsewhere like a refused one."""

    kind = "first_byte_timeout"


#: A stream read by a task (``UpstreamResponse.iter_any``) pauses its connection's reading while
#: more than this many bytes wait for the reader (a slow client: the task waits on the client's
#: drain), so that the engine is held back by TCP flow control instead of the router buffering the
#: answer. (The callback path's relay pauses on the client's own write buffer.)
STREAM_BUFFER_BYTES = 256 * 1024

#: An answer's header block, line by line up to the empty line that ends it, in one C pass: group
#: 1 is the value of its last content-type line (the name in any case; the value as llhttp gives
#: it, leading blanks dropped, the rest to the line's end), None without one. llhttp has accepted
#: the block before this reads it (on_headers_complete): every line ends with CRLF, none is
#: folded, no value holds a CR, so each repeat is one whole header line and the body is not read.
_HEAD = re.compile(rb"[^\r]*(?:\r\n(?:content-type:[ \t]*([^\r]*)|[^\r]+))*", re.IGNORECASE)

#: A request body this long or longer goes out after its head in one scatter write (``writelines``:
#: the transport's writev), not copied behind the head into one bytes first: a 16K-token chat body
#: is ~48 KB, and the copy (with its allocation) is a cost per byte of every such request. A shorter
#: body is joined to its head (one write of one buffer is cheaper than two small ones).
SCATTER_BODY_BYTES = 16 * 1024

#: A request as it is written to an engine: its bytes, or its head and its body (a long body,
#: ``SCATTER_BODY_BYTES``).
Request: TypeAlias = bytes | tuple[bytes, bytes]


class UpstreamResponse:
    """An engine's answer on a pooled connection: ``status`` (0 until its headers are in) and
    ``content_type`` (the engine's content-type, latin-1 bytes, or application/json when it sent
    none: the one header of the answer the router relays), then the body as it arrives
    (``iter_any``/``read``); ``done`` once the whole answer is in, ``error`` (an UpstreamError)
    once it failed. ``close`` before the end drops the connection, which is what cancels the
    request in the engine.

    Only what differs per answer is stored on the instance (no ``__slots__``): the rest reads the
    class's defaults until the answer changes it, so an answer costs a few stores, not one per
    attribute."""

    status = 0
    content_type = b"application/json"
    #: The whole answer is in; why it failed (None: it did not).
    done = False
    error: UpstreamError | None = None
    #: An SSE ``data:`` event arrived.
    event_seen = False
    #: Called instead of waking an awaiting reader, on every change (headers, body bytes, the
    #: end, a failure): the callback path's relay (router/routing.py); None = await as usual.
    on_event: Callable[[], None] | None = None
    #: Bytes in ``_chunks`` counted against STREAM_BUFFER_BYTES (-1: not counted, until
    #: ``iter_any`` reads the answer).
    _buffered = -1
    _waiter: asyncio.Future[None] | None = None
    #: How to send the request again on a new connection (a reused connection's answer only, once
    #: ``headers_of`` waits for it).
    _retry: tuple[_Pool, Request, float | None, bool] | None = None

    def __init__(self, conn: _Connection, url: str) -> None:
        self._conn: _Connection | None = conn
        self.url = url
        # The loop the client runs on, not asyncio.get_running_loop(): on Python 3.11 that is a
        # getpid() system call per await.
        self._loop = conn.loop
        self._chunks: list[bytes] = []

    def _wake(self) -> None:
        on_event = self.on_event
        if on_event is not None:
            on_event()
            return
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if not self.done and self.error is None:
            self.error = error
        self._wake()

    async def _wait(self) -> None:
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        except BaseException:
            self.close()  # cancelled (client gone, first-byte budget): the engine must stop
            raise

    def take_body(self) -> bytes:
        """The body bytes in so far (``read`` without the wait), taken; a connection paused for
        the bytes a task's reader left waiting (``count_buffered``) reads on."""
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        if self._buffered > 0:
            self._buffered = 0
            conn = self._conn
            if conn is not None and conn.full:
                conn.buffer_full(False)
        return data

    def count_buffered(self) -> None:
        """From now on a task reads the body (``take_body`` between ``wait_body``): more than
        STREAM_BUFFER_BYTES waiting for it pause the connection's reading."""
        self._buffered = 0

    async def wait_body(self) -> None:
        """Wait for more of the body, its end or a failure (``take_body``, ``done``, ``error``)."""
        if not self._chunks and not self.done and self.error is None:
            await self._wait()

    async def headers_in(self) -> None:
        while not self.status:
            if self.error is not None:
                raise self.error
            await self._wait()

    async def iter_any(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (chunked framing removed); UpstreamError when it breaks off.
        What arrived while the reader was away comes as one piece (one write to the client, not
        one per network read)."""
        chunks = self._chunks
        self.count_buffered()
        while True:
            if chunks:
                yield self.take_body()
                continue
            if self.done:
                return
            if self.error is not None:
                raise self.error
            await self._wait()

    async def first_event(self) -> list[bytes]:
        """The body up to its first chunk holding an SSE ``data:`` event (keep-alive comments
        before it kept), left unread: ``iter_any`` yields these chunks again. The stream's
        deadline is ``send``'s (``until_event``), failing with UpstreamFirstByteTimeout; an error
        before the event is retryable too (UpstreamConnectError): no byte reached the client."""
        chunks = self._chunks
        while not self.event_seen and not self.done:
            error = self.error
            if error is not None:
                if isinstance(error, UpstreamConnectError):
                    raise error
                raise UpstreamConnectError(f"the stream broke before its first event: {error}")
            await self._wait()
        head = []
        for chunk in chunks:
            head.append(chunk)
            if b"data:" in chunk:
                break
        return head

    async def read(self) -> bytes:
        """The whole body (what ``iter_any`` would yield, joined; no generator per answer), taken;
        failures are UpstreamErrors."""
        while not self.done:
            if self.error is not None:
                raise self.error
            await self._wait()
        chunks = self._chunks
        return chunks.pop() if len(chunks) == 1 else self.take_body()  # (one piece: no frame)

    def pause_reading(self, paused: bool) -> None:
        """Stop (True) or resume reading the answer off its connection: the engine is held back by
        TCP flow control, and the read timeout does not count the pause (a slow client)."""
        conn = self._conn
        if conn is not None:
            conn.pause_reading(paused)

    def close(self) -> None:
        conn = self._conn
        if conn is not None:
            self._conn = None
            if not self.done:
                conn.abort()

    def release(self) -> None:
        self.close()


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to an engine, carrying one exchange at a time. httptools
    frames the answer (status, body, end, keep-alive) and calls back once per event, never per
    header: the one header the router needs is read off the header block in one pass."""

    #: Set when connected (before the connection is used).
    transport: asyncio.Transport

    def __init__(self, pool: _Pool, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.loop = loop
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        #: The answer's bytes so far while its header block is not complete (b"" after it).
        self.head = b""
        #: When the last bytes came (or the request went): the read timeout's start, and once the
        #: connection is idle, the keep-alive timeout's.
        self.last_io_s = 0.0
        self.lost = False
        #: Reading paused (``paused``) by the answer's reader (``UpstreamResponse.pause_reading``), or
        #: while a task's reader is away with more than STREAM_BUFFER_BYTES waiting.
        self.held = False
        self.full = False
        #: The running exchange's first-byte deadline (monotonic; 0 = none) and whether it lasts
        #: until the first SSE event of a 200 answer.
        self.first_byte_due_s = 0.0
        self.budget_s = 0.0
        self.until_event = False

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.last_io_s = time.monotonic()
        response = self.response
        if response is None:  # bytes nobody asked for: the connection cannot be trusted
            self.abort()
            return
        if not response.status:  # the header block, read by on_headers_complete (b"" + data: no copy)
            self.head += data
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            response._fail(UpstreamError(f"{response.url}: malformed HTTP answer: {exc}"))
            self.abort()
            return
        # Whoever reads the answer is woken once per chunk, after all of it is parsed (headers,
        # body bytes and the end of a whole answer often come in one chunk).
        response._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.end(self, False)
        response, self.response = self.response, None
        if response is not None and not response.done:
            response._conn = None
            if response.status:
                response._fail(UpstreamError(f"engine response broke off: {exc or 'connection closed'}"))
            else:
                response._fail(UpstreamConnectError(f"{response.url} closed the connection before answering"))

    # -- httptools callbacks (no on_header: llhttp then calls no Python per header)
    def on_headers_complete(self) -> None:
        head, self.head = self.head, b""
        response = self.response
        if response is not None:
            content_type = _HEAD.match(head)[1]  # type: ignore[index]  # (it always matches)
            if content_type is not None:
                response.content_type = content_type
            response.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        response = self.response
        if response is not None:
            if not response.event_seen and b"data:" in body:
                response.event_seen = True
            response._chunks.append(body)
            if response._buffered >= 0:
                response._buffered += len(body)
                if response._buffered > STREAM_BUFFER_BYTES and not self.full:
                    self.buffer_full(True)

    def on_message_complete(self) -> None:
        response, self.response = self.response, None
        if response is None:
            return
        response.done = True
        response._conn = None
        if self.full:  # the whole answer is in: nothing left to hold back
            self.buffer_full(False)
        if not self.held and self.parser.should_keep_alive() and not self.lost:
            self.pool.end(self, True)
        else:
            self.abort()

    @property
    def paused(self) -> bool:
        return self.held or self.full

    def pause_reading(self, paused: bool) -> None:
        self.held = paused
        self._apply_pause()

    def buffer_full(self, full: bool) -> None:
        self.full = full
        self._apply_pause()

    def _apply_pause(self) -> None:
        transport = self.transport
        if self.lost or self.paused != transport.is_reading():
            return
        if self.paused:
            transport.pause_reading()
        else:
            self.last_io_s = time.monotonic()  # the read timeout counts from the end of the pause
            transport.resume_reading()

    # -- the pool's side
    def abort(self) -> None:
        if not self.lost:
            self.transport.abort()
        self.lost = True
        self.pool.end(self, False)


class _Pool:
    """Idle keep-alive connections to one engine (host, port, TLS), most recently used first."""

    def __init__(self, client: UpstreamClient, host: str, port: int, tls: bool) -> None:
        self.client = client
        self.host, self.port, self.tls = host, port, tls
        self.idle: list[_Connection] = []
        #: Connections being opened, and requests waiting for a connection to be free (only with
        #: limits.max_connections_per_engine).
        self.connecting = 0
        self.waiters: deque[asyncio.Future[None]] = deque()
        self.head = f"host: {host}:{port}\r\n".encode("latin-1")

    def end(self, conn: _Connection, reuse: bool) -> None:
        """``conn``'s exchange (if any) is over: a waiter for a connection slot may go; ``reuse``:
        ``conn`` goes back to the idle list (closed after the keep-alive timeout by one sweep
        timer), else it is gone from the pool."""
        running = self.client._running
        if conn in running:
            running.discard(conn)
            if self.waiters:
                self._next_waiter()
        if reuse:
            self.idle.append(conn)
            if self.client._sweeper is None:
                self.client._note_idle()
        elif conn in self.idle:
            self.idle.remove(conn)

    def busy(self) -> int:
        """Connections carrying an exchange or being opened (counted when a limit applies only,
        not per exchange)."""
        return self.connecting + sum(1 for conn in self.client._running if conn.pool is self)

    def _next_waiter(self) -> None:
        waiters = self.waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break


class UpstreamClient:
    """Shared pooled client; create in the app's lifespan (needs a running loop), then ``close``."""

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_connections_per_engine: int = 0,
        keepalive_timeout_s: float = 3.0,
    ) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._limit_per_host = max_connections_per_engine
        # Below uvicorn's (and so vLLM's) 5 s keep-alive, so the pool never reuses a socket the
        # engine is about to close.
        self._keepalive_timeout_s = keepalive_timeout_s
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_read=read_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        #: URL -> its engine's pool and the request's head up to the headers (request line, host).
        self._pools: dict[str, tuple[_Pool, bytes]] = {}
        #: The loop the client runs on (set by ``start`` or the first connection; each connection
        #: keeps its own, for its answers' waits and the deadline timer).
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Connections carrying an exchange (their deadlines are checked by ``_tick``).
        self._running: set[_Connection] = set()
        #: The same set, read-only for others: empty while no exchange is in progress.
        self.exchanges: Set[_Connection] = self._running
        self._ticker: asyncio.TimerHandle | None = None
        self._tls: ssl.SSLContext | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        #: Requests sent again on a new connection after a pooled one turned out dead.
        self.stale_retries = 0

    @property
    def session(self) -> aiohttp.ClientSession:
        """An aiohttp session for the router's occasional requests (health polls)."""
        if self._session is None:
            raise RuntimeError("UpstreamClient.start() was not called (the app lifespan starts it)")
        return self._session

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self._keepalive_timeout_s)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=self._timeout,
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
            )

    async def close(self) -> None:
        for handle in (self._ticker, self._sweeper):
            if handle is not None:
                handle.cancel()
        self._ticker = self._sweeper = None
        for pool, _ in self._pools.values():
            for conn in list(pool.idle):
                conn.abort()
            pool.idle.clear()
        self._pools.clear()
        self._loop = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _pool_of(self, url: str) -> tuple[_Pool, bytes]:
        """The pool of ``url``'s engine and the request's head up to its headers: the request line
        and the host header (cached per URL: the senders look in ``_pools`` first, no call per
        request)."""
        found = self._pools.get(url)
        if found is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise UpstreamError(f"{url}: engine URLs must be http:// or https://")
            tls = parts.scheme == "https"
            host, port = parts.hostname, parts.port or (443 if tls else 80)
            pool = next(
                (p for p, _ in self._pools.values() if (p.host, p.port, p.tls) == (host, port, tls)), None
            ) or _Pool(self, host, port, tls)
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            found = self._pools[url] = (pool, b"POST %s HTTP/1.1\r\n%s" % (path.encode("latin-1"), pool.head))
        return found

    def _note_idle(self) -> None:
        """Idle connections are closed after the keep-alive timeout (one sweep timer)."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(self._keepalive_timeout_s, self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        now_s = time.monotonic()
        any_idle = False
        for pool, _ in list(self._pools.values()):
            keep = []
            for conn in pool.idle:
                if conn.lost:
                    continue
                if now_s - conn.last_io_s >= self._keepalive_timeout_s:
                    conn.abort()
                else:
                    keep.append(conn)
            pool.idle[:] = keep
            any_idle = any_idle or bool(keep)
        if any_idle:
            self._note_idle()

    def _tick(self) -> None:
        """Fail the exchanges past their first-byte deadline (UpstreamFirstByteTimeout) or silent
        for the read timeout (UpstreamTimeout); closing the connection stops the engine's work."""
        self._ticker = None
        now_s = time.monotonic()
        read_timeout_s = self._read_timeout_s
        failed: list[tuple[float, int, UpstreamResponse, UpstreamError]] = []
        for conn in list(self._running):
            response = conn.response
            if response is None:
                continue
            error: UpstreamError | None = None
            if conn.first_byte_due_s and now_s >= conn.first_byte_due_s:
                status = response.status
                if not status or (conn.until_event and status == 200 and not response.event_seen):
                    what = "no first token" if status else "no answer"
                    error = UpstreamFirstByteTimeout(
                        f"{response.url} sent {what} within the first-byte budget ({conn.budget_s:.1f} s)"
                    )
                else:
                    conn.first_byte_due_s = 0.0
            if error is None and not conn.paused and now_s - conn.last_io_s >= read_timeout_s:
                error = UpstreamTimeout(f"{response.url}: engine sent nothing within the read timeout")
            if error is not None:
                failed.append((conn.first_byte_due_s, len(failed), response, error))
        # Failed in the order their deadlines fell due (not the set's): requests the router sends
        # again at once (escalation: ``Router._escalate``) keep their order within a tick.
        for _, _, response, error in sorted(failed):
            response._fail(error)
            response.close()
        if self._running:
            self._ticker = asyncio.get_running_loop().call_later(DEADLINE_TICK_S, self._tick)

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    async def _connect(self, pool: _Pool, url: str) -> _Connection:
        loop = self._loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(pool, loop),
                    pool.host,
                    pool.port,
                    # https engines: the system's CA store and hostname check, as aiohttp did.
                    ssl=self._tls_context() if pool.tls else None,
                )
        except TimeoutError:
            raise UpstreamConnectError(
                f"cannot connect to {url}: no connection within the connect timeout"
            ) from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {url}: {exc}") from exc
        return conn

    async def send(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str] | bytes,
        *,
        first_byte_timeout_s: float | None = None,
        until_event: bool = False,
    ) -> UpstreamResponse:
        """POST ``body`` unchanged to ``url``; the response is open once its headers are in (the
        caller must ``close`` it). ``first_byte_timeout_s`` bounds the wait for the headers and,
        with ``until_event``, for a 200 answer's first SSE ``data:`` event as well: then the
        answer fails with UpstreamFirstByteTimeout (wait for it with ``first_event``).
        ``headers``: a mapping, or its header lines already encoded (``encode_headers``)."""
        if not isinstance(headers, bytes):
            headers = encode_headers(headers)
        pool, request, response = self._begin(url, headers, body, first_byte_timeout_s, until_event)
        reused = response is not None
        if response is None:
            response = await self._start_new(pool, url, request, first_byte_timeout_s, until_event)
        # The first wake-up, awaited here (not in ``headers_of``'s coroutines): it is usually the
        # whole answer, or at least its header block, in one read.
        await response._wait()
        if not response.status:  # a header block split across reads, or a failure before it
            if reused:
                response._retry = (pool, request, first_byte_timeout_s, until_event)
            return await self.headers_of(response)
        return response

    def send_on_idle(
        self,
        url: str,
        body: bytes,
        header_lines: bytes,
        *,
        first_byte_timeout_s: float | None = None,
        until_event: bool = False,
    ) -> UpstreamResponse | None:
        """``send`` without an await: the request written on an idle keep-alive connection to
        ``url``'s engine and its answer returned at once (headers not in yet: ``headers_of``, or
        its ``on_event``); None when no idle connection is there (use ``send``)."""
        pool, request, response = self._begin(url, header_lines, body, first_byte_timeout_s, until_event)
        if response is not None:
            response._retry = (pool, request, first_byte_timeout_s, until_event)
        return response

    def _begin(
        self,
        url: str,
        header_lines: bytes,
        body: bytes,
        first_byte_timeout_s: float | None,
        until_event: bool,
    ) -> tuple[_Pool, Request, UpstreamResponse | None]:
        """The request to ``url``'s engine, its pool, and its answer if it went out on an idle
        keep-alive connection (None: no idle connection; the caller opens one)."""
        pool, request_head = self._pools.get(url) or self._pool_of(url)
        request: Request
        if len(body) < SCATTER_BODY_BYTES:
            request = b"%s%scontent-length: %d\r\n\r\n%s" % (request_head, header_lines, len(body), body)
        else:
            request = (b"%s%scontent-length: %d\r\n\r\n" % (request_head, header_lines, len(body)), body)
        return pool, request, self._start(pool, None, url, request, first_byte_timeout_s, until_event)

    async def headers_of(self, response: UpstreamResponse) -> UpstreamResponse:
        """``response`` once its headers are in (see ``send``): on a reused connection that turns
        out dead before any answer, the request goes once more on a new connection."""
        try:
            await response.headers_in()
        except UpstreamFirstByteTimeout:
            raise
        except UpstreamConnectError:
            if response._retry is None:
                raise
            # A pooled keep-alive socket the engine had closed or reset while it sat idle (the
            # engine restarted, or its keep-alive ran out first): that says nothing about the
            # engine, so once more on a new connection; only a failure of that one counts.
            pool, request, first_byte_timeout_s, until_event = response._retry
            self.stale_retries += 1
            conn = await self._new_connection(pool, response.url)
            started = self._start(pool, conn, response.url, request, first_byte_timeout_s, until_event)
            assert started is not None
            response = started
            await response.headers_in()
        return response

    async def _start_new(
        self, pool: _Pool, url: str, request: Request, first_byte_timeout_s: float | None, until_event: bool
    ) -> UpstreamResponse:
        """``_start`` when ``pool`` had no idle connection: on a new one, or with
        limits.max_connections_per_engine, once a connection is free (an idle one, if one came
        back meanwhile)."""
        if self._limit_per_host:
            while pool.busy() >= self._limit_per_host:
                waiter = asyncio.get_running_loop().create_future()
                pool.waiters.append(waiter)
                await waiter
            response = self._start(pool, None, url, request, first_byte_timeout_s, until_event)
            if response is not None:
                response._retry = (pool, request, first_byte_timeout_s, until_event)
                return response
        conn = await self._new_connection(pool, url)
        response = self._start(pool, conn, url, request, first_byte_timeout_s, until_event)
        assert response is not None
        return response

    async def _new_connection(self, pool: _Pool, url: str) -> _Connection:
        pool.connecting += 1  # counted while connecting, so the limit holds
        try:
            return await self._connect(pool, url)
        finally:
            pool.connecting -= 1

    def _start(
        self,
        pool: _Pool,
        conn: _Connection | None,
        url: str,
        request: Request,
        first_byte_timeout_s: float | None,
        until_event: bool,
    ) -> UpstreamResponse | None:
        """Send ``request`` on ``conn`` and arm its deadlines (checked by ``_tick``). ``conn`` None:
        on the most recently used idle keep-alive connection of ``pool`` (closed ones and those
        idle for the keep-alive timeout dropped on the way); None if there is none."""
        now_s = time.monotonic()
        if conn is None:
            idle = pool.idle
            while True:
                if not idle:
                    return None
                conn = idle.pop()
                if now_s - conn.last_io_s < self._keepalive_timeout_s and not conn.lost:
                    break
                conn.abort()
        response = conn.response = UpstreamResponse(conn, url)
        conn.last_io_s = now_s
        if isinstance(request, bytes):
            conn.transport.write(request)
        else:
            conn.transport.writelines(request)
        if first_byte_timeout_s is None:
            conn.first_byte_due_s = 0.0
        else:
            conn.first_byte_due_s = now_s + first_byte_timeout_s
            conn.budget_s = first_byte_timeout_s
            conn.until_event = until_event
        self._running.add(conn)
        if self._ticker is None:
            self._ticker = conn.loop.call_later(DEADLINE_TICK_S, self._tick)
        return response


def encode_headers(headers: Mapping[str, str]) -> bytes:
    """Header lines (``name: value\\r\\n`` each) as ``UpstreamClient.send`` writes them."""
    return b"".join(
        b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()
    )


async def iter_body(response: UpstreamResponse) -> AsyncIterator[bytes]:
    """The response body as the bytes arrive (no buffering); failures are UpstreamErrors."""
    async for chunk in response.iter_any():
        if chunk:
            yield chunk
