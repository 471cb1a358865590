"""The router's front door: connection-level limits, authentication and a last-resort error guard.

``guarded_http_protocol(limits)`` is uvicorn's httptools protocol with header read timeouts, header
size/count limits and a connection cap (slow or idle clients must not hold sockets forever).
``AccessGuard`` is the ASGI middleware around the app: client API keys, admin token and access to
the introspection endpoints (constant-time comparisons, failures rate-limited per address), and an
answer of 500 for any error the app did not handle, without dropping the keep-alive connection.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from collections import OrderedDict, deque
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.config import LimitsConfig, RouterConfig
from router.errors import RouterError

log = logging.getLogger("kvroute.guard")

#: Where the authenticated tenant is kept for the handlers (ASGI ``scope["state"]``).
TENANT_STATE_KEY = "kvroute_tenant"

CLIENT_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")
DEBUG_PATHS = ("/v1/route/explain", "/v1/experiments", "/debug/")
ADMIN_PREFIX = "/admin/"

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


def guarded_http_protocol(limits: LimitsConfig) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with ``limits``' header timeout, header size and count limits and
    connection cap; pass it as ``uvicorn.Config(http=...)``."""

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        header_timeout_s = limits.header_timeout_s
        max_header_bytes = limits.max_header_bytes
        max_headers = limits.max_headers
        max_connections = limits.max_connections

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_bytes = 0
            self._header_count = 0
            self._in_headers = True
            self._header_timer: asyncio.TimerHandle | None = None
            if self.max_connections and len(self.connections) > self.max_connections:
                # Refuse at once and cheaply: a full connection table must not starve the others.
                self._reject(503, b"too many connections")
                return
            self._start_header_timer()

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
            self._stop_header_timer()
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n%s" % (status, _REASONS[status], len(message), message)
            )
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():
                return
            super().data_received(data)
            if self._in_headers and not self.transport.is_closing():
                # Still inside a header block after parsing all of it: every byte was header. A
                # coarse bound (the exact one is checked once the headers are complete) so that
                # an endless header line cannot grow without limit.
                self._header_bytes += len(data)
                if self._header_bytes > self.max_header_bytes + 1024 * 1024:
                    self._reject(431, b"request headers exceed limits.max_header_bytes")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_headers = True
            self._header_count = 0
            self._start_header_timer()

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_count += 1
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_headers = False
            self._stop_header_timer()
            too_many = self._header_count > self.max_headers
            too_big = sum(len(n) + len(v) + 4 for n, v in self.headers) + len(self.url)
            self._header_bytes = 0
            if not too_many and too_big <= self.max_header_bytes:
                super().on_headers_complete()
                return
            # Answer through uvicorn's own request cycle (it keeps parsing any body that follows)
            # with an app that refuses: the same way it answers over limit_concurrency.
            app, self.app = self.app, _headers_too_large(b"header lines" if too_many else b"header bytes")
            try:
                super().on_headers_complete()
            finally:
                self.app = app

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._header_bytes = 0

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_header_timer()
            super().connection_lost(exc)

    return GuardedHttpToolsProtocol


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


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


class FailureLimiter:
    """Failed authentications per client address in a sliding minute (bounded address table)."""

    def __init__(self, max_per_minute: int, *, max_addresses: int = 10_000) -> None:
        self.max_per_minute = max_per_minute
        self._max_addresses = max_addresses
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def _recent(self, address: str, now: float) -> deque[float] | None:
        times = self._failures.get(address)
        if times is not None:
            while times and now - times[0] > 60.0:
                times.popleft()
        return times

    def blocked(self, address: str, now: float) -> bool:
        times = self._recent(address, now)
        return times is not None and len(times) >= self.max_per_minute

    def fail(self, address: str, now: float) -> None:
        times = self._recent(address, now)
        if times is None:
            times = self._failures[address] = deque(maxlen=self.max_per_minute)
            while len(self._failures) > self._max_addresses:
                self._failures.popitem(last=False)
        times.append(now)


class Authenticator:
    """Who is calling: a client API key (-> tenant) or the admin token; comparisons in constant time."""

    def __init__(self, config: RouterConfig) -> None:
        self._keys = {_digest(key): tenant for key, tenant in config.auth.api_keys.items()}
        self._admin = _digest(config.admin.token) if config.admin.token else None
        self.clients_need_key = bool(self._keys)
        self.debug_mode = config.auth.debug_mode()
        self.limiter = FailureLimiter(config.auth.max_failures_per_minute)

    def tenant_of(self, token: str) -> str | None:
        """The tenant of a client key, or None. The dict lookup is on a digest (no early exit on a
        matching prefix); the found entry is confirmed with hmac.compare_digest."""
        digest = _digest(token)
        for key_digest, tenant in self._keys.items():
            if hmac.compare_digest(key_digest, digest):
                return tenant
        return None

    def is_admin(self, token: str) -> bool:
        return self._admin is not None and hmac.compare_digest(self._admin, _digest(token))

    def required(self, path: str) -> str:
        """What ``path`` needs: "" (nothing), "client", "debug:<mode>" or "admin"."""
        if path.startswith(ADMIN_PREFIX):
            return "admin"
        if path.startswith(DEBUG_PATHS):
            return "" if self.debug_mode == "open" else "debug"
        if self.clients_need_key and path.startswith(CLIENT_PATHS):
            return "client"
        return ""

    def check(self, scope: dict[str, Any], need: str) -> None:
        """Raise RouterError unless the request's bearer token grants ``need``; store its tenant."""
        address = (scope.get("client") or ("-", 0))[0]
        now = time.monotonic()
        if need == "admin" and self._admin is None:
            raise RouterError(
                404,
                "admin endpoints are disabled; set admin.token to enable them",
                type="not_found_error",
                code="admin_disabled",
            )
        if need == "debug" and (self.debug_mode == "off" or (self.debug_mode == "admin" and not self._admin)):
            raise RouterError(
                404,
                "this endpoint is disabled (auth.debug_access is off, or admin without an admin.token)",
                type="not_found_error",
                code="disabled",
            )
        if self.limiter.blocked(address, now):
            raise RouterError(
                429,
                "too many failed authentications from this address; retry in a minute",
                type="rate_limit_error",
                code="auth_rate_limited",
                headers={"retry-after": "60"},
            )
        token = _bearer(scope)
        if token is None:
            self.limiter.fail(address, now)
            what = "admin.token" if need == "admin" or self.debug_mode == "admin" else "API key"
            raise RouterError(
                401,
                f"missing 'Authorization: Bearer <{what}>' header",
                type="authentication_error",
                code="missing_admin_token" if what == "admin.token" else "missing_api_key",
            )
        admin = self.is_admin(token)
        tenant = None if admin else self.tenant_of(token)
        allowed = admin or (tenant is not None and (need == "client" or self.debug_mode == "api_key"))
        if not allowed:
            self.limiter.fail(address, now)
            if need == "admin" or (need == "debug" and self.debug_mode == "admin"):
                raise RouterError(
                    403, "wrong admin token", type="permission_error", code="invalid_admin_token"
                )
            raise RouterError(401, "invalid API key", type="authentication_error", code="invalid_api_key")
        if tenant is not None:
            scope.setdefault("state", {})[TENANT_STATE_KEY] = tenant


def _bearer(scope: dict[str, Any]) -> str | None:
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            text = value.decode("latin-1")
            if text[:7].lower() == "bearer " and text[7:].strip():
                return text[7:].strip()
            return None
    return None


async def send_error(send: Any, err: RouterError, request_id: str = "") -> None:
    """Send ``err`` as a complete OpenAI-shaped JSON response through ASGI ``send``."""
    body = err.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if request_id:
        headers.append((b"x-request-id", request_id.encode()))
    for name, value in (err.headers or {}).items():
        headers.append((name.encode(), value.encode()))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class AccessGuard:
    """ASGI middleware: authentication by path, and a JSON 500 for errors nothing else handled
    (Starlette's own handler re-raises, and uvicorn then closes a keep-alive connection without
    saying so: the client's next request on it fails)."""

    def __init__(self, app: Any, auth: Authenticator) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        need = self.auth.required(scope["path"])
        if need:
            try:
                self.auth.check(scope, need)
            except RouterError as err:
                log.warning("%s %s: %d %s", scope.get("method"), scope["path"], err.status, err.code)
                await send_error(send, err)
                return
        try:
            await self.app(scope, receive, send)
        except Exception:
            log.exception("%s %s: unexpected error", scope.get("method"), scope["path"])
            internal = RouterError(
                500, "internal router error; see the router log", type="server_error", code="internal_error"
            )
            try:
                await send_error(send, internal)
            except RuntimeError:
                # The answer had started: returning without finishing it makes uvicorn abort the
                # connection, which is what a client must see for a broken answer.
                pass
