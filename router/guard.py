"""The router's front door: connection-level limits, authentication and a last-resort error guard.

``guarded_http_protocol(limits)`` is kvroute's HTTP protocol (uvicorn's httptools protocol that
answers the proxied routes itself, router/fastpath.py) with header read timeouts, header size/count
limits and a connection cap (slow or idle clients must not hold sockets forever). The per-request
part of these limits runs in that protocol's own hooks (one hook per parser event); this module sets
the limits and keeps what is per connection: the cap and its evictions, the client write timeout.
``AccessGuard`` is the ASGI middleware around the app: client API keys, admin token and access to
the introspection endpoints (constant-time comparisons, failures rate-limited per address), and an
answer of 500 for any error the app did not handle, without dropping the keep-alive connection.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import hmac
import ipaddress
import logging
import struct
import termios
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.config import LimitsConfig, RouterConfig
from router.errors import RouterError
from router.fastpath import ProxyHttpProtocol

log = logging.getLogger("kvroute.guard")

#: Where the authenticated tenant is kept for the handlers (ASGI ``scope["state"]``).
TENANT_STATE_KEY = "kvroute_tenant"

#: On the introspection endpoints, an admin names the tenant whose routing to inspect (explain runs
#: with that tenant's cache_salt, as the tenant's own requests do).
INSPECT_TENANT_HEADER = b"x-kvroute-tenant"

CLIENT_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")
DEBUG_PATHS = ("/v1/route/explain", "/v1/experiments", "/debug/")
ADMIN_PREFIX = "/admin/"

#: How often, per ``limits.client_write_timeout_s``, a connection whose writing is paused is looked
#: at for progress: a client is cut 1 to 1.25 timeouts after the last byte its side took.
WRITE_TIMEOUT_CHECKS = 4


def unacknowledged_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes the transport's socket has sent or queued that its peer has not acknowledged yet
    (Linux's SIOCOUTQ; 0 where it cannot be read): what a client has yet to take beyond the
    transport's own write buffer."""
    sock = transport.get_extra_info("socket")
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0])
    except (AttributeError, OSError, ValueError):
        return 0


def connection_reserve(max_connections: int) -> int:
    """Slots of the connection cap that connections still waiting for (or sending) a request can
    never take: kept for requests that arrive and complete their headers quickly."""
    return max(1, max_connections // 10)


def guarded_http_protocol(limits: LimitsConfig) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with ``limits``' header timeout, header size and count limits and
    connection cap; pass it as ``uvicorn.Config(http=...)``.

    Memory: header bytes are fed to the parser only up to ``max_header_bytes`` plus a small slack, so
    a connection sending an endless header line holds at most that much (the parser keeps a header
    line whole until it ends).

    The cap: connections are *waiting* (no request yet, or its headers incomplete: idle keep-alive,
    slowloris), *uploading* (headers in, body not complete: a slow body) or *active* (the request is
    complete; the router works on it or streams the answer). Waiting and uploading connections
    together hold at most ``max_connections - connection_reserve(max_connections)`` slots; past that,
    and past the cap, a new connection evicts the one that has waited longest: the earliest to start
    waiting for its request or its body (a fresh connection is the youngest, so it has the time to
    send its request). Only when every slot is active is a newcomer refused with 503."""

    class GuardedHttpToolsProtocol(ProxyHttpProtocol):
        header_timeout_s = limits.header_timeout_s
        max_header_bytes = limits.max_header_bytes
        max_headers = limits.max_headers
        max_connections = limits.max_connections
        client_write_timeout_s = limits.client_write_timeout_s
        #: Since when the client has taken none of the bytes waiting for it (loop time; 0: writing
        #: is not paused), how many were waiting at the last look, and the one timer that looks.
        _write_stalled_since_s = 0.0
        _write_pending_bytes = 0
        _write_timer: asyncio.TimerHandle | None = None
        max_pending = max(1, limits.max_connections - connection_reserve(limits.max_connections))
        # Shared by the connections of one server, oldest first (dicts keep insertion order).
        waiting: ClassVar[dict[Any, None]] = {}
        uploading: ClassVar[dict[Any, None]] = {}
        evictions = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._waiting_since_s = self.loop.time()  # since this phase (waiting / uploading) began
            if self.max_connections:
                pending = len(self.waiting) + len(self.uploading)
                if pending >= self.max_pending or len(self.connections) > self.max_connections:
                    if not self._evict_one():
                        # Every slot holds a complete request: refuse at once and cheaply.
                        self._reject(503, b"too many connections")
                        return
            self.waiting[self] = None
            self._start_header_timer()

        def _evict_one(self) -> bool:
            """Close the connection that has waited longest for its request or its body (each
            table is in the order its connections began waiting: its first is its oldest)."""
            oldest = [next(iter(table)) for table in (self.waiting, self.uploading) if table]
            if not oldest:
                return False
            min(oldest, key=lambda c: c._waiting_since_s)._evict()
            type(self).evictions += 1
            return True

        def _evict(self) -> None:
            self.waiting.pop(self, None)
            self.uploading.pop(self, None)
            if self._in_headers and self._header_bytes == 0 and self._answered_one:
                # Idle between requests: close quietly, as a keep-alive timeout would (clients
                # retry a request on a reused connection that closes).
                self._stop_header_timer()
                self.transport.close()
            elif self._in_headers:
                self._reject(503, b"connection evicted: the router is at limits.max_connections")
            else:
                self.transport.close()  # mid-upload: the handler sees a disconnect (499)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self.client_write_timeout_s:
                # The client's buffer is over its high-water mark: the client write timeout counts
                # from now, looked at by one timer per connection (armed only while paused).
                self._write_stalled_since_s = now = self.loop.time()
                self._write_pending_bytes = self._write_pending()
                if self._write_timer is None:
                    self._write_timer = self.loop.call_at(
                        now + self.client_write_timeout_s / WRITE_TIMEOUT_CHECKS, self._write_due
                    )

        def resume_writing(self) -> None:
            self._write_stalled_since_s = 0.0  # (its timer, when it fires, finds nothing to do)
            super().resume_writing()

        def _write_due(self) -> None:
            """The client write timeout's timer: a client that took any of the bytes waiting for it
            since the last look has its clock started again; one that took none for
            ``client_write_timeout_s`` is cut. (Bytes written while paused - a stream's end - can
            hide one look's progress; the next look sees the client's reading again.)"""
            self._write_timer = None
            since_s = self._write_stalled_since_s
            if not since_s:
                return
            now = self.loop.time()
            pending = self._write_pending()
            if pending < self._write_pending_bytes:
                self._write_stalled_since_s = since_s = now
            self._write_pending_bytes = pending
            timeout_s = self.client_write_timeout_s
            if now - since_s >= timeout_s:
                self._write_timed_out(pending, now - since_s)
            else:
                self._write_timer = self.loop.call_at(
                    min(since_s + timeout_s, now + timeout_s / WRITE_TIMEOUT_CHECKS), self._write_due
                )

        def _write_pending(self) -> int:
            """Bytes the client has yet to take: the transport's buffer and the socket's queue (the
            kernel's buffers hold megabytes: a client reading slowly drains them long before the
            transport's buffer moves)."""
            transport = self.transport
            return transport.get_write_buffer_size() + unacknowledged_bytes(transport)

        def _write_timed_out(self, pending: int, stalled_s: float) -> None:
            """Abort the connection of a client that took none of its answer for the timeout. A
            request still being answered (a stream) is finished by its relay with the reason (its
            log line; the engine's connection closed, which stops the request there); the log line
            is this one when the answer was complete (the engine's part was done). Counted either
            way (``kvroute_client_write_timeouts_total``); the engine's breaker is not charged."""
            reason = (
                f"client write timeout: the client took none of the {pending} bytes waiting for it "
                f"for {stalled_s:.1f} s (limits.client_write_timeout_s)"
            )
            cycle = self.cycle
            headers = getattr(cycle, "answer_headers", None) or {}
            engine = headers.get(b"x-kvroute-engine", b"none").decode("latin-1")
            cut = getattr(cycle, "cut", None)
            if cut is None or not cut(reason):
                log.warning(
                    "request %s on engine %s: %s; connection aborted (its answer had left the engine)",
                    headers.get(b"x-request-id", b"-").decode("latin-1"),
                    engine,
                    reason,
                )
            count = getattr(self.app, "on_client_write_timeout", None)
            if count is not None:
                count(engine)
            self._write_stalled_since_s = 0.0
            self.transport.abort()

        def connection_lost(self, exc: Exception | None) -> None:
            self._write_stalled_since_s = 0.0
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None
            super().connection_lost(exc)

    return GuardedHttpToolsProtocol


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


class FailureLimiter:
    """Failed authentications per key (a client address, or a presented credential's digest) in a
    sliding minute; the key table is bounded (the oldest key goes first)."""

    def __init__(self, max_per_minute: int, *, max_keys: int = 10_000) -> None:
        self.max_per_minute = max_per_minute
        self._max_keys = max_keys
        self._failures: OrderedDict[str | bytes, deque[float]] = OrderedDict()

    def _recent(self, key: str | bytes, now: float) -> deque[float] | None:
        times = self._failures.get(key)
        if times is not None:
            while times and now - times[0] > 60.0:
                times.popleft()
        return times

    def blocked(self, key: str | bytes, now: float) -> bool:
        times = self._recent(key, now)
        return times is not None and len(times) >= self.max_per_minute

    def fail(self, key: str | bytes, now: float) -> None:
        times = self._recent(key, now)
        if times is None:
            times = self._failures[key] = deque(maxlen=self.max_per_minute)
            while len(self._failures) > self._max_keys:
                self._failures.popitem(last=False)
        times.append(now)


class ClientAddress:
    """The client's address of a request: the TCP peer, or - only when the peer is one of
    ``auth.trusted_proxies`` - the rightmost ``X-Forwarded-For`` entry that is not itself a trusted
    proxy (entries further left were written by the client and prove nothing)."""

    def __init__(self, trusted_proxies: list[str]) -> None:
        self._trusted = [ipaddress.ip_network(p, strict=False) for p in trusted_proxies]

    def _is_trusted(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in network for network in self._trusted)

    def of(self, scope: dict[str, Any]) -> str:
        peer = str((scope.get("client") or ("-", 0))[0])
        if not self._trusted or not self._is_trusted(peer):
            return peer
        forwarded: list[str] = [
            part.strip()
            for name, value in scope.get("headers") or ()
            if name == b"x-forwarded-for"
            for part in value.decode("latin-1").split(",")
        ]
        for hop in reversed(forwarded):
            if not self._is_trusted(hop):
                try:
                    return str(ipaddress.ip_address(hop))
                except ValueError:
                    return peer  # garbage where the proxy writes the address: count the proxy
        return peer


class Authenticator:
    """Who is calling: a client API key (-> tenant) or the admin token; comparisons in constant time.

    Failures are limited per client address and per presented credential (``FailureLimiter``),
    and only failures are refused: a valid credential is checked first and always accepted, so a
    misconfigured client behind the same NAT or load balancer cannot lock the others out."""

    def __init__(self, config: RouterConfig) -> None:
        self._keys = {_digest(key): tenant for key, tenant in config.auth.api_keys.items()}
        self._tenants = set(config.auth.api_keys.values())
        self._admin = _digest(config.admin.token) if config.admin.token else None
        self.clients_need_key = bool(self._keys)
        self.debug_mode = config.auth.debug_mode()
        self.by_address = FailureLimiter(config.auth.max_failures_per_minute)
        self.by_credential = FailureLimiter(config.auth.max_failures_per_minute)
        self.client_address = ClientAddress(config.auth.trusted_proxies)

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
        token = _bearer(scope)
        admin_needed = need == "admin" or (need == "debug" and self.debug_mode == "admin")
        if token is not None:
            admin = self.is_admin(token)
            tenant = None if admin else self.tenant_of(token)
            if admin or (tenant is not None and not admin_needed):
                if admin and need == "debug":
                    tenant = self._inspected_tenant(scope)
                if tenant is not None:
                    scope.setdefault("state", {})[TENANT_STATE_KEY] = tenant
                return
        address = self.client_address.of(scope)
        credential = _digest(token) if token is not None else None
        now = time.monotonic()
        if self.by_address.blocked(address, now) or (
            credential is not None and self.by_credential.blocked(credential, now)
        ):
            raise RouterError(
                429,
                "too many failed authentications from this address or with this credential; "
                "retry in a minute",
                type="rate_limit_error",
                code="auth_rate_limited",
                headers={"retry-after": "60"},
            )
        self.by_address.fail(address, now)
        if credential is not None:
            self.by_credential.fail(credential, now)
        if token is None:
            what = "admin.token" if admin_needed else "API key"
            raise RouterError(
                401,
                f"missing 'Authorization: Bearer <{what}>' header",
                type="authentication_error",
                code="missing_admin_token" if admin_needed else "missing_api_key",
            )
        if admin_needed:
            raise RouterError(403, "wrong admin token", type="permission_error", code="invalid_admin_token")
        raise RouterError(401, "invalid API key", type="authentication_error", code="invalid_api_key")

    def _inspected_tenant(self, scope: dict[str, Any]) -> str | None:
        """The tenant an admin names in ``x-kvroute-tenant`` (None: none named); 404 for a tenant
        no API key maps to."""
        for name, value in scope.get("headers") or ():
            if name == INSPECT_TENANT_HEADER:
                tenant = value.decode("latin-1").strip()
                if self._tenants and tenant not in self._tenants:
                    raise RouterError(
                        404,
                        f"x-kvroute-tenant names no tenant of auth.api_keys: {tenant[:64]!r}",
                        type="not_found_error",
                        code="tenant_not_found",
                    )
                return tenant or None
        return None


def _bearer(scope: dict[str, Any]) -> str | None:
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            text = value.decode("latin-1")
            if text[:7].lower() == "bearer " and text[7:].strip():
                return text[7:].strip()
            return None
    return None


def error_headers(err: RouterError, request_id: str = "") -> list[tuple[bytes, bytes]]:
    """The headers of ``err``'s answer but its content-length."""
    headers = [(b"content-type", b"application/json")]
    if request_id:
        headers.append((b"x-request-id", request_id.encode()))
    for name, value in (err.headers or {}).items():
        headers.append((name.encode(), value.encode()))
    return headers


async def send_error(send: Any, err: RouterError, request_id: str = "") -> None:
    """Send ``err`` as a complete OpenAI-shaped JSON response through ASGI ``send``."""
    body = err.body()
    headers = [*error_headers(err, request_id), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class AccessGuard:
    """ASGI middleware: authentication by path, and a JSON 500 for errors nothing else handled
    (Starlette's own handler re-raises, and uvicorn then closes a keep-alive connection without
    saying so: the client's next request on it fails)."""

    def __init__(self, app: Any, auth: Authenticator, paths: Iterable[str] = ()) -> None:
        """``paths``: the paths ``app`` mostly serves (the proxied routes); what they require is
        looked up once here (it depends on the config only), not per request."""
        self.app = app
        self.auth = auth
        self._need_of = {path: auth.required(path) for path in paths}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        need = self._need_of.get(path)
        if need is None:
            need = self.auth.required(path)
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
