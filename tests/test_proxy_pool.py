"""router.proxy.UpstreamClient against a real HTTP server on loopback: connections are kept alive
and reused, deadlines (first byte, first event, read) fire from the shared timer, the connection
cap holds, and failures get the kind the router's fail-over reads."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from router.proxy import (
    UpstreamClient,
    UpstreamConnectError,
    UpstreamError,
    UpstreamFirstByteTimeout,
    UpstreamTimeout,
    iter_body,
)

OK = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 12\r\n\r\n{"ok": true}'
#: Answers without a body (no content-length needed: the status says so), and one whose content-type
#: value ends in blanks (kept, as llhttp gives it).
NO_BODY = {
    b"/204": b"HTTP/1.1 204 No Content\r\nx-a: 1\r\n\r\n",
    b"/304": b"HTTP/1.1 304 Not Modified\r\ncontent-length: 12\r\n\r\n",
}
BLANKS = b"HTTP/1.1 200 OK\r\nContent-Type:  text/x  \r\ncontent-length: 2\r\n\r\nok"
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Engine:
    """A loopback HTTP/1.1 server answering by path; counts connections and concurrent requests."""

    def __init__(self) -> None:
        self.connections = 0
        self.active = 0
        self.max_active = 0
        self.server: asyncio.Server | None = None
        self.gate = asyncio.Event()
        self.two_active = asyncio.Event()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> Engine:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        self.gate.set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                path = head.split(b" ")[1]
                self.active += 1
                self.max_active = max(self.max_active, self.active)
                if self.active >= 2:
                    self.two_active.set()
                try:
                    await self._answer(path, writer)
                finally:
                    self.active -= 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _answer(self, path: bytes, writer: asyncio.StreamWriter) -> None:
        if path == b"/ok":
            writer.write(OK)
        elif path in NO_BODY:
            writer.write(NO_BODY[path])
        elif path == b"/blanks":
            writer.write(BLANKS)
        elif path == b"/gated":
            await self.gate.wait()
            writer.write(OK)
        elif path == b"/silent":  # never answers
            await asyncio.sleep(3600)
        elif path == b"/stall":  # headers, then nothing
            writer.write(SSE_HEAD)
            await asyncio.sleep(3600)
        elif path == b"/stream":
            writer.write(SSE_HEAD + _chunk(b": keep-alive\n\n"))
            for i in range(3):
                await asyncio.sleep(0.01)
                writer.write(_chunk(b"data: %d\n\n" % i))
            writer.write(b"0\r\n\r\n")
        elif path == b"/broken":  # one event, then the connection drops mid-answer
            writer.write(SSE_HEAD + _chunk(b"data: 0\n\n"))
            await writer.drain()
            writer.transport.abort()
            raise ConnectionError
        await writer.drain()


@pytest.fixture
async def client() -> AsyncIterator[UpstreamClient]:
    c = UpstreamClient(connect_timeout_s=2.0, read_timeout_s=0.3)
    await c.start()
    yield c
    await c.close()


async def test_keep_alive_connection_is_reused(client: UpstreamClient) -> None:
    async with Engine() as engine:
        for _ in range(5):
            response = await client.send(engine.url + "/ok", b"{}", {"content-type": "application/json"})
            assert response.status == 200 and response.content_type == b"application/json"
            assert await response.read() == b'{"ok": true}'
        assert engine.connections == 1  # a new connection per request would be 5
        # Nothing of a finished exchange stays armed: deadline state kept per request until its
        # 600 s read timeout would grow with the request rate.
        assert not client._running


@pytest.mark.parametrize("path", ["/204", "/304"])
async def test_an_answer_without_a_body(client: UpstreamClient, path: str) -> None:
    async with Engine() as engine:
        for _ in range(2):
            response = await client.send(engine.url + path, b"{}", {})
            assert response.status == int(path[1:]) and response.done
            assert response.content_type == b"application/json"  # (none sent)
            assert await response.read() == b""
        assert engine.connections == 1  # the connection is kept: it did not wait for a body


async def test_the_content_type_as_llhttp_gives_it(client: UpstreamClient) -> None:
    """Leading blanks dropped, trailing ones kept, the bytes as sent (the header block's one pass
    and httptools' per-header callbacks, which it replaces, agree)."""
    async with Engine() as engine:
        response = await client.send(engine.url + "/blanks", b"{}", {})
        assert response.content_type == b"text/x  " and await response.read() == b"ok"


async def test_a_whole_answer_in_one_chunk_wakes_its_reader_once_with_all_of_it(
    client: UpstreamClient,
) -> None:
    """The answer's callback (``on_event``, the callback path's relay) runs once per chunk read,
    after the whole chunk is parsed: an answer that comes in one chunk is seen complete - status,
    headers, body and its end - by the first and only call, with its connection already back in the
    pool for the next request."""
    async with Engine() as engine:
        await (await client.send(engine.url + "/ok", b"{}", {})).read()  # a pooled connection
        response = client.send_on_idle(engine.url + "/ok", b"{}", b"")
        assert response is not None
        seen: list[tuple[int, bytes, bool, bytes, int]] = []
        pool, _ = client._pool_of(engine.url + "/ok")
        done = asyncio.Event()

        def on_event() -> None:
            seen.append(
                (
                    response.status,
                    response.content_type,
                    response.done,
                    response.take_body(),
                    len(pool.idle),
                )
            )
            done.set()

        response.on_event = on_event
        await asyncio.wait_for(done.wait(), 5)
        await asyncio.sleep(0.05)  # nothing more comes for this answer
        assert seen == [(200, b"application/json", True, b'{"ok": true}', 1)]


async def test_stream_relays_events_and_its_connection_goes_back_to_the_pool(client: UpstreamClient) -> None:
    async with Engine() as engine:
        for _ in range(2):
            response = await client.send(
                engine.url + "/stream", b"{}", {}, first_byte_timeout_s=1.0, until_event=True
            )
            head = await response.first_event()
            assert head == [b": keep-alive\n\n", b"data: 0\n\n"]
            # Waiting for the first event reads nothing: the relay starts from the first byte. (What
            # arrived while nobody read comes as one piece: compare the bytes.)
            relayed = b"".join([c async for c in iter_body(response)])
            assert relayed == b"".join(head) + b"data: 1\n\ndata: 2\n\n"
        assert engine.connections == 1


async def test_no_first_event_in_the_budget_is_a_first_byte_timeout(client: UpstreamClient) -> None:
    async with Engine() as engine:
        with pytest.raises(UpstreamFirstByteTimeout, match="no answer"):
            await client.send(engine.url + "/silent", b"{}", {}, first_byte_timeout_s=0.1)
        # Headers but no event: the same budget, counted to the first event (retryable elsewhere).
        response = await client.send(
            engine.url + "/stall", b"{}", {}, first_byte_timeout_s=0.1, until_event=True
        )
        with pytest.raises(UpstreamFirstByteTimeout, match="no first token"):
            await response.first_event()


async def test_read_timeout_and_a_broken_answer(client: UpstreamClient) -> None:
    async with Engine() as engine:
        response = await client.send(engine.url + "/stall", b"{}", {})
        with pytest.raises(UpstreamTimeout):  # read_timeout_s = 0.3: nothing after the headers
            await response.read()
        response = await client.send(engine.url + "/broken", b"{}", {})
        chunks = iter_body(response)
        assert await chunks.__anext__() == b"data: 0\n\n"
        with pytest.raises(UpstreamError) as info:
            await chunks.__anext__()
        assert not isinstance(info.value, UpstreamConnectError)  # bytes were relayed: no retry


async def test_refused_connection_is_retryable(client: UpstreamClient) -> None:
    async with Engine() as engine:
        url = engine.url
    await asyncio.sleep(0.05)
    with pytest.raises(UpstreamConnectError, match="cannot connect"):
        await client.send(url + "/ok", b"{}", {})


async def test_https_engine_urls_speak_tls(client: UpstreamClient) -> None:
    async with Engine() as engine:  # a plain-HTTP server: the TLS handshake cannot succeed
        with pytest.raises(UpstreamConnectError, match="cannot connect"):
            await client.send(engine.url.replace("http://", "https://") + "/ok", b"{}", {})
        assert engine.connections == 1  # it did connect (TLS, not a refused or skipped URL)


async def test_connection_cap_per_engine_holds() -> None:
    client = UpstreamClient(connect_timeout_s=2.0, read_timeout_s=5.0, max_connections_per_engine=2)
    await client.start()
    try:
        async with Engine() as engine:

            async def one() -> bytes:
                response = await client.send(engine.url + "/gated", b"{}", {})
                return await response.read()

            tasks = [asyncio.create_task(one()) for _ in range(5)]
            await asyncio.wait_for(engine.two_active.wait(), 5)
            await asyncio.sleep(0.1)  # time for a third connection, if the cap let one through
            assert engine.active == 2  # the other three wait for a free connection
            engine.gate.set()
            assert await asyncio.gather(*tasks) == [b'{"ok": true}'] * 5
            assert engine.max_active == 2 and engine.connections == 2
    finally:
        await client.close()
