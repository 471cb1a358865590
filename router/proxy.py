"""The one upstream HTTP client of the router: pooled aiohttp connections to every engine.

aiohttp was chosen over httpx by measurement (docs/benchmarks.md, loadtest/bench_proxy.py): on
2 cores a FastAPI proxy on aiohttp's client served ~10x the requests/s of the same proxy on httpx.
``UpstreamClient.send`` posts the original body bytes and returns the open response once its
headers are in, so the caller can stream the body through; failures are classified into
``UpstreamConnectError`` (refused, or the connection broke before any byte of an answer: safe to
retry elsewhere) and ``UpstreamTimeout`` (the engine took longer than the read timeout to answer).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import aiohttp

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
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_read=read_timeout_s)
        self._limit_per_host = max_connections_per_engine
        # Below uvicorn's (and so vLLM's) 5 s keep-alive, so the pool never reuses a socket the
        # engine is about to close.
        self._keepalive_timeout_s = keepalive_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._fresh_session: aiohttp.ClientSession | None = None  # no pool: for stale-socket retries
        #: Requests sent again on a new connection after a pooled one turned out dead.
        self.stale_retries = 0

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("UpstreamClient.start() was not called (the app lifespan starts it)")
        return self._session

    async def start(self) -> None:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=0, limit_per_host=self._limit_per_host, keepalive_timeout=self._keepalive_timeout_s
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=self._timeout,
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
            )
            self._fresh_session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=True),
                timeout=self._timeout,
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
            )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._fresh_session is not None:
            await self._fresh_session.close()
            self._fresh_session = None

    async def _post(self, url: str, body: bytes, headers: Mapping[str, str]) -> aiohttp.ClientResponse:
        """POST on a pooled connection; if that connection turns out dead before any answer (the
        engine closed or reset an idle keep-alive socket: it restarted, or its keep-alive ran out),
        once more on a new connection. Only a failure of that one says something about the engine."""
        try:
            return await self.session.post(url, data=body, headers=headers, allow_redirects=False)
        except aiohttp.ClientConnectorError:
            raise  # could not connect at all: nothing stale about it
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            if self._fresh_session is None:
                raise
            self.stale_retries += 1
            return await self._fresh_session.post(url, data=body, headers=headers, allow_redirects=False)

    async def send(
        self, url: str, body: bytes, headers: Mapping[str, str], *, first_byte_timeout_s: float | None = None
    ) -> aiohttp.ClientResponse:
        """POST ``body`` unchanged to ``url``; the response is open (caller must ``release`` it).
        ``first_byte_timeout_s`` bounds the wait for the response headers."""
        try:
            if first_byte_timeout_s is None:
                return await self._post(url, body, headers)
            try:
                async with asyncio.timeout(first_byte_timeout_s):
                    return await self._post(url, body, headers)
            except TimeoutError:
                raise UpstreamFirstByteTimeout(
                    f"{url} sent no answer within the first-byte budget ({first_byte_timeout_s:.1f} s)"
                ) from None
        except aiohttp.ClientConnectorError as exc:  # refused, unreachable, DNS, connect timeout
            raise UpstreamConnectError(f"cannot connect to {url}: {exc.os_error or exc}") from exc
        except aiohttp.ServerDisconnectedError as exc:
            raise UpstreamConnectError(f"{url} closed the connection before answering") from exc
        except aiohttp.ClientOSError as exc:
            # ECONNRESET / EPIPE on a new connection too ("Can not write request body"): the
            # engine answered nothing, so the request may go elsewhere like a refused one.
            raise UpstreamConnectError(f"connection to {url} broke before any answer: {exc}") from exc
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise UpstreamTimeout(f"{url} did not answer within the read timeout") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"request to {url} failed: {type(exc).__name__}: {exc}") from exc


async def first_event(
    chunks: AsyncIterator[bytes], timeout_s: float
) -> tuple[list[bytes], AsyncIterator[bytes]]:
    """Read ``chunks`` up to the first one holding an SSE ``data:`` event (keep-alive comments
    before it are kept) within ``timeout_s``; UpstreamFirstByteTimeout when it does not come, and
    an error before it is retryable too (UpstreamConnectError): no byte reached the client."""
    head: list[bytes] = []
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in chunks:
                head.append(chunk)
                if b"data:" in chunk:
                    return head, chunks
    except TimeoutError:
        raise UpstreamFirstByteTimeout(
            f"no first token within the first-byte budget ({timeout_s:.1f} s)"
        ) from None
    except UpstreamError as exc:
        raise UpstreamConnectError(f"the stream broke before its first event: {exc}") from exc
    return head, chunks  # the stream ended without an event: passed on as it is


async def iter_body(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The response body as the bytes arrive (no buffering); errors mapped to UpstreamError."""
    try:
        async for chunk in response.content.iter_any():
            if chunk:
                yield chunk
    except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
        raise UpstreamTimeout("engine stopped sending within the read timeout") from exc
    except aiohttp.ClientError as exc:
        raise UpstreamError(f"engine response broke off: {type(exc).__name__}: {exc}") from exc


async def read_body(response: aiohttp.ClientResponse) -> bytes:
    """The whole response body (a non-stream answer); errors mapped to UpstreamError."""
    try:
        return await response.read()
    except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
        raise UpstreamTimeout("engine stopped sending within the read timeout") from exc
    except aiohttp.ClientError as exc:
        raise UpstreamError(f"engine response broke off: {type(exc).__name__}: {exc}") from exc
