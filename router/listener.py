"""The router's listening socket: every pending connection accepted each time the socket is ready.

uvloop's server (libuv 1.52 under uvloop 0.23) accepts one connection per turn of the event loop.
At full load a turn of kvroute's loop takes 10-15 ms, so a burst of new connections (a client pool
opening, load-test users starting, a balancer reconnecting) waited its turn one at a time: 64
connections opened together were taken over ~0.4 s, their first requests 100-430 ms late (B3 at
c64, docs/benchmarks.md). ``AcceptingServer`` takes what is pending at once (up to
``ACCEPT_BATCH`` a turn, as asyncio's own selector loop does) and hands each socket to the loop's
transport; uvicorn keeps everything else (protocols, connection tracking, graceful shutdown).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvroute.listener")

#: Connections accepted per readiness of the listening socket at most; the rest wait one turn (a
#: flood of connects cannot hold the loop from the requests already in).
ACCEPT_BATCH = 128
#: How long accepting pauses when the process or the system is out of file descriptors (the
#: pending connections wait in the kernel's backlog meanwhile instead of spinning the loop).
NO_FD_PAUSE_S = 0.5
_NO_FD = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class AcceptingServer:
    """Serves ``protocol_factory`` on the bound socket ``sock``: the object uvicorn keeps in
    ``Server.servers`` (``close`` stops accepting, ``wait_closed``)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        protocol_factory: Callable[[], asyncio.Protocol],
        sock: socket.socket,
        backlog: int,
    ) -> None:
        self._loop = loop
        self._factory = protocol_factory
        self._sock = sock
        self.sockets = [sock]
        sock.setblocking(False)
        sock.listen(backlog)
        self._fd = sock.fileno()
        self._nodelay = sock.family in (socket.AF_INET, socket.AF_INET6)
        #: Connections being handed to a transport (a task each: the loop holds tasks weakly).
        self._starting: set[asyncio.Task[Any]] = set()
        self._resume: asyncio.TimerHandle | None = None
        self._closed = asyncio.Event()
        self.accepted = 0
        loop.add_reader(self._fd, self._accept)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # the client gave up while it waited in the backlog
            except OSError as exc:
                if exc.errno in _NO_FD:
                    self._pause(exc)
                else:
                    log.error("accepting a connection failed: %s", exc)
                return
            self.accepted += 1
            try:
                conn.setblocking(False)
                if self._nodelay:
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError as exc:  # reset already: nothing to serve, the others go on
                log.info("dropped a connection before it started: %s", exc)
                conn.close()
                continue
            task = self._loop.create_task(self._start(conn))
            self._starting.add(task)
            task.add_done_callback(self._starting.discard)

    async def _start(self, conn: socket.socket) -> None:
        try:
            _, protocol = await self._loop.connect_accepted_socket(self._factory, conn)
        except Exception as exc:  # the client reset the socket before its transport was made
            log.info("dropped a connection before it started: %s", exc)
            conn.close()
            return
        if self._closed.is_set():
            # Accepted before the server closed, made after: uvicorn's shutdown told the
            # connections it knew to finish; this one is told too (router/fastpath.py's shutdown
            # still answers its first request if it comes soon).
            shutdown = getattr(protocol, "shutdown", None)
            if shutdown is not None:
                shutdown()

    def _pause(self, exc: OSError) -> None:
        """Out of file descriptors: stop accepting for NO_FD_PAUSE_S (the socket stays readable,
        so accepting on would spin the loop), then try again."""
        log.warning(
            "cannot accept connections: %s; pausing %.1f s (raise the open-files limit, `ulimit -n`, "
            "or lower limits.max_connections)",
            exc.strerror or exc,
            NO_FD_PAUSE_S,
        )
        self._loop.remove_reader(self._fd)
        self._resume = self._loop.call_later(NO_FD_PAUSE_S, self._go_on)

    def _go_on(self) -> None:
        self._resume = None
        if not self._closed.is_set():
            self._loop.add_reader(self._fd, self._accept)
            self._accept()

    def close(self) -> None:
        """Stop accepting (uvicorn's shutdown; the socket itself is closed by its owner)."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        else:
            self._loop.remove_reader(self._fd)

    async def wait_closed(self) -> None:
        await self._closed.wait()
        if self._starting:
            await asyncio.gather(*self._starting, return_exceptions=True)
