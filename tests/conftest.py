"""Shared test fixtures: free loopback ports, ASGI apps served by real uvicorn in a thread, and a
small recording OpenAI-compatible upstream (``OpenAIUpstream``) that can be told to delay or fail."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from hypothesis import settings
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

# CI runs the property tests on fixed examples (a red run must be reproducible, not luck of the
# draw); developers' runs keep exploring new ones. Either way nothing is stored in the clone.
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("dev", database=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

# TEST_KVROUTE_CALLBACK_PATH=1 / 0: the routers the tests serve in-process (``ThreadedServer``)
# answer every proxied request they can from callbacks (proxy.callback_path true, whatever each
# test's config) / the default's requests all on tasks (false for a config at the default, "idle",
# which answers from callbacks while no other exchange is in progress).
# TEST_KVROUTE_DEFER_ACCOUNTING=1 / 0: the whole run with proxy.defer_accounting on / off (on by
# default): the routers the tests serve in-process (``ThreadedServer``) and, through the variable
# of the key, the ``kvroute serve`` processes they start.
_DEFER = os.environ.get("TEST_KVROUTE_DEFER_ACCOUNTING")
if _DEFER in ("0", "1"):
    os.environ.setdefault("KVROUTE_PROXY_DEFER_ACCOUNTING", "true" if _DEFER == "1" else "false")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (bind to port 0, read it back, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class ThreadedServer:
    """A uvicorn server for ``app`` on a free loopback port, in its own thread and event loop."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.host = host
        self.port = port or free_port(host)
        options: dict[str, Any] = {}
        router_config = getattr(getattr(app, "state", None), "config", None)
        if getattr(app, "proxy_app", None) is not None and router_config is not None:
            # The router runs on the protocol `kvroute serve` runs (router/guard.py, router/fastpath.py):
            # the proxied routes are answered inside it, the rest through the ASGI app.
            from router.guard import guarded_http_protocol

            options = {"http": guarded_http_protocol(router_config.limits), "proxy_headers": False}
            callbacks = os.environ.get("TEST_KVROUTE_CALLBACK_PATH")
            if callbacks == "1":
                # The whole run on the callback path (proxy.callback_path), whatever each test's
                # config and however busy the router.
                app.proxy_now, app.callback_busy = app.callback_proxy, ()
            elif callbacks == "0" and router_config.proxy.callback_path == "idle":
                app.proxy_now = None  # the default's requests all on tasks (proxy.callback_path off)
            router = getattr(app.state, "router", None)
            defer = _DEFER
            if defer in ("0", "1") and router is not None:
                # The whole run with proxy.defer_accounting on (1) or off (0), whatever each test's
                # config (on by default).
                from router.after_answer import AfterAnswer

                if defer == "0":
                    app.after_answer = router.after_answer = None
                elif router.after_answer is None:
                    app.after_answer = router.after_answer = AfterAnswer()
        config = uvicorn.Config(
            app,
            host=host,
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="on",
            loop="asyncio",
            **options,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """While inside, a SIGTERM to this process (a CI job's timeout, ``kill``) ends the test run as
    Ctrl-C does, so the fixtures' finalizers stop what they started in sessions of their own (vLLM
    engines hold gigabytes each); Python's default action exits at once and leaves them running.
    KeyboardInterrupt, not loadtest.bench_peers.exit_on_sigterm's SystemExit: pytest reports that as
    one failing test and goes on. A no-op outside the main thread, where no handler can be set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture(autouse=True)
def _signal_handlers_restored() -> Iterator[None]:
    """A test that runs a command's ``main`` in-process (a benchmark installs a SIGTERM handler that
    raises SystemExit) leaves no handler to the tests after it: their forked workers would inherit
    it (see sim.des_cli.worker_pool)."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


@pytest.fixture
def serve_asgi() -> Iterator[Callable[..., ThreadedServer]]:
    """Factory: ``serve_asgi(app)`` -> started ThreadedServer; all are stopped after the test."""
    servers: list[ThreadedServer] = []

    def start(app: Any, **kwargs: Any) -> ThreadedServer:
        server = ThreadedServer(app, **kwargs)
        servers.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in reversed(servers):
            server.stop()


@dataclass
class OpenAIUpstream:
    """A tiny OpenAI-compatible engine stand-in that records what it received.

    Controls (set from the test thread): ``delay_s`` before answering, ``fail_status`` to answer
    an error instead, ``chunk_delay_s`` / ``chunks`` for streams, ``health_status`` for /health.
    """

    name: str
    model: str = "test-model"
    delay_s: float = 0.0
    fail_status: int = 0
    chunks: int = 3
    chunk_delay_s: float = 0.0
    health_status: int = 200
    cached_tokens: int = 7
    bodies: list[bytes] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    #: Streams whose client (the router) went away before the end.
    cancelled_streams: int = 0

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self._generate, methods=["POST"]),
                Route("/v1/completions", self._generate, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
            ]
        )

    async def _health(self, request: Request) -> Response:
        return Response(status_code=self.health_status)

    async def _models(self, request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model,
                        "object": "model",
                        "created": 0,
                        "owned_by": self.name,
                        "max_model_len": 4096,
                    }
                ],
            }
        )

    def _usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": 20,
            "completion_tokens": self.chunks,
            "total_tokens": 20 + self.chunks,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    async def _generate(self, request: Request) -> Response:
        raw = await request.body()
        self.bodies.append(raw)
        self.headers.append(dict(request.headers))
        # delay_s is re-read so that the test's thread can cut a delay short (an asyncio.Event
        # could not be set from that thread).
        started = time.monotonic()
        while time.monotonic() - started < self.delay_s:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        if self.fail_status:
            return JSONResponse(
                {
                    "error": {
                        "message": f"{self.name} says no",
                        "type": "BadRequestError",
                        "code": self.fail_status,
                    }
                },
                status_code=self.fail_status,
            )
        body = json.loads(raw)
        chat = request.url.path.endswith("/chat/completions")
        if body.get("stream"):
            return StreamingResponse(self._sse(chat, body), media_type="text/event-stream")
        text = " ".join(f"tok{i}" for i in range(self.chunks))
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            if chat
            else {"index": 0, "text": text, "finish_reason": "stop"}
        )
        return JSONResponse(
            {
                "id": f"{self.name}-1",
                "object": "chat.completion" if chat else "text_completion",
                "created": 0,
                "model": body.get("model"),
                "choices": [choice],
                "usage": self._usage(),
            }
        )

    async def _sse(self, chat: bool, body: dict[str, Any]) -> AsyncIterator[bytes]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        finished = False
        try:
            yield b": keep-alive\n\n"
            for i in range(self.chunks):
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
                piece = f"tok{i} "
                choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                doc = {
                    "id": f"{self.name}-s",
                    "object": kind,
                    "created": 0,
                    "model": body.get("model"),
                    "choices": [choice],
                }
                yield f"data: {json.dumps(doc)}\n\n".encode()
            if (body.get("stream_options") or {}).get("include_usage"):
                doc = {
                    "id": f"{self.name}-s",
                    "object": kind,
                    "created": 0,
                    "model": body.get("model"),
                    "choices": [],
                    "usage": self._usage(),
                }
                yield f"data: {json.dumps(doc)}\n\n".encode()
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                self.cancelled_streams += 1


@pytest.fixture
def upstreams(serve_asgi: Callable[..., ThreadedServer]) -> Callable[[int], list[tuple[OpenAIUpstream, str]]]:
    """Factory: ``upstreams(n)`` -> n started (OpenAIUpstream, base_url) pairs named e0..e{n-1}."""

    def start(n: int) -> list[tuple[OpenAIUpstream, str]]:
        out = []
        for i in range(n):
            upstream = OpenAIUpstream(name=f"e{i}")
            out.append((upstream, serve_asgi(upstream.app()).url))
        return out

    return start


@pytest.fixture
def task_starts(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every proxied or ASGI request the protocol started as an asyncio task."""
    started: list[object] = []
    from router.fastpath import ProxyHttpProtocol

    original = ProxyHttpProtocol._start_asgi_task

    def counting(self: Any, cycle: Any, app: Any) -> None:
        started.append(cycle)
        original(self, cycle, app)

    monkeypatch.setattr(ProxyHttpProtocol, "_start_asgi_task", counting)
    return started
