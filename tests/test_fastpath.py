"""The proxied routes answered inside the HTTP protocol (router/fastpath.py), on real sockets: which
requests take it, pipelining and keep-alive next to ASGI requests, HTTP/1.0, 100-continue, a body
in pieces, and a client that hangs up mid-stream."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from router.app import create_app
from router.config import RouterConfig, load_config
from tests.conftest import OpenAIUpstream, ThreadedServer

MODEL = "test-model"


def round_robin_config(urls: list[str], *, callback_path: bool = False, **sections: Any) -> RouterConfig:
    """A round_robin router over engines e0, e1, ... at ``urls`` (serving MODEL), no health polling,
    on the chosen proxy path; ``sections`` are further config sections."""
    return load_config(
        environ={},
        overrides={
            "engines": [{"id": f"e{i}", "url": url, "model": MODEL} for i, url in enumerate(urls)],
            "health": {"interval_s": 0},
            "policy": {"name": "round_robin"},
            "proxy": {"callback_path": callback_path},
            **sections,
        },
    )


def chat(stream: bool = False, text: str = "hi") -> bytes:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 3}
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


def post(path: str, body: bytes, extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    return (
        b"POST %s HTTP/%s\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
        % (path.encode(), version, len(body), extra, body)
    )


def read_answers(
    sock: socket.socket, count: int, timeout_s: float = 30.0, pending: bytes = b""
) -> list[httpx.Response]:
    """``count`` HTTP/1.1 answers read off ``sock`` in order (content-length or chunked bodies);
    ``pending``: bytes of them already read off the socket."""
    sock.settimeout(timeout_s)
    data = pending
    answers: list[httpx.Response] = []
    while len(answers) < count:
        while b"\r\n\r\n" not in data:
            more = sock.recv(65536)
            if not more:
                raise AssertionError(f"connection closed after {len(answers)} answers: {data[:200]!r}")
            data += more
        head, data = data.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = dict(line.split(": ", 1) for line in lines[1:])
        headers = {k.lower(): v for k, v in headers.items()}
        if "content-length" in headers:
            size = int(headers["content-length"])
            while len(data) < size:
                data += sock.recv(65536)
            body, data = data[:size], data[size:]
        else:
            assert headers.get("transfer-encoding") == "chunked", headers
            body = b""
            while True:
                while b"\r\n" not in data:
                    data += sock.recv(65536)
                size_line, rest = data.split(b"\r\n", 1)
                size = int(size_line, 16)
                while len(rest) < size + 2:
                    rest += sock.recv(65536)
                body += rest[:size]
                data = rest[size + 2 :]
                if size == 0:
                    break
        answers.append(httpx.Response(status, headers=headers, content=body))
    return answers


def assert_kinds(server: ThreadedServer, kinds: list[str], proxied: int) -> None:
    """Every proxied request ran on the exchange (on the callback path, those it answered or
    handed over itself do not reach the recorded ``proxy_app``)."""
    if server.server.config.app.proxy_now is None:
        assert kinds == ["ProxyExchange"] * proxied
    else:
        assert len(kinds) <= proxied and set(kinds) <= {"ProxyExchange"}


@pytest.fixture
def router(
    serve_asgi: Callable[..., ThreadedServer], upstreams: Any
) -> tuple[ThreadedServer, list[str], Any]:
    engines = upstreams(2)
    config = load_config(
        environ={},
        overrides={
            "engines": [{"id": u.name, "url": url, "model": MODEL} for u, url in engines],
            "health": {"interval_s": 0},
            "policy": {"name": "round_robin"},
        },
    )
    app = create_app(config)
    # Record which kind of exchange the guarded proxy ran on, per request.
    kinds: list[str] = []
    proxy_app = app.proxy_app
    assert proxy_app is not None

    async def recording(scope: Any, receive: Any, send: Any) -> None:
        kinds.append(type(getattr(receive, "__self__", None)).__name__)
        await proxy_app(scope, receive, send)

    app.proxy_app = recording
    return serve_asgi(app), kinds, engines


def test_proxied_posts_take_the_exchange_everything_else_the_asgi_app(router) -> None:
    server, kinds, _ = router
    with httpx.Client(base_url=server.url) as client:
        assert (
            client.post(
                "/v1/chat/completions", content=chat(), headers={"content-type": "application/json"}
            ).status_code
            == 200
        )
        answer = client.post(
            "/v1/chat/completions", content=chat(stream=True), headers={"content-type": "application/json"}
        )
        assert answer.status_code == 200 and answer.text.rstrip().endswith("data: [DONE]")
        assert client.get("/ready").status_code == 200
        assert client.get("/v1/models").json()["data"]
        # A GET of a proxied path is not the proxy's: FastAPI answers 405.
        assert client.get("/v1/chat/completions").status_code == 405
    assert_kinds(server, kinds, 2)


def test_pipelined_requests_answer_in_order_across_both_paths(router) -> None:
    server, kinds, _ = router
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(
            post("/v1/chat/completions", chat(text="first"))
            + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
            + post("/v1/chat/completions", chat(stream=True, text="third"))
            + post(
                "/v1/completions", json.dumps({"model": MODEL, "prompt": "fourth", "max_tokens": 2}).encode()
            )
        )
        first, second, third, fourth = read_answers(sock, 4)
    assert first.status_code == 200 and first.json()["object"] == "chat.completion"
    assert second.status_code == 200 and second.json() == {"status": "ok"}
    assert third.status_code == 200 and third.text.rstrip().endswith("data: [DONE]")
    assert fourth.status_code == 200 and fourth.json()["object"] == "text_completion"
    assert_kinds(server, kinds, 3)


def test_keep_alive_many_requests_one_connection_and_errors_keep_it(router) -> None:
    server, _, _ = router
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        for i in range(20):
            body = b"{not json" if i % 5 == 4 else chat(stream=i % 2 == 1)
            sock.sendall(post("/v1/chat/completions", body))
            (answer,) = read_answers(sock, 1)
            if i % 5 == 4:
                assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_json"
            else:
                assert answer.status_code == 200
            assert answer.headers.get("connection") != "close"


def test_keep_alive_timeout_closes_an_idle_connection_and_never_a_busy_one(upstreams: Any) -> None:
    """The keep-alive timer is one per connection, re-armed only when it fires (router/fastpath.py):
    a connection whose requests keep coming stays open across several timeouts' worth of time,
    and one left idle is closed about the timeout after its last answer."""
    engines = upstreams(1)
    config = load_config(
        environ={},
        overrides={
            "engines": [{"id": u.name, "url": url, "model": MODEL} for u, url in engines],
            "health": {"interval_s": 0},
        },
    )
    server = ThreadedServer(create_app(config))
    server.server.config.timeout_keep_alive = 0.5  # read by each new connection's protocol
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            started = time.monotonic()
            while time.monotonic() - started < 2.0:  # four timeouts' worth, a request every 0.2 s
                sock.sendall(post("/v1/chat/completions", chat()))
                (answer,) = read_answers(sock, 1)
                answered = time.monotonic()  # the idle time counts from the last answer
                assert answer.status_code == 200
                time.sleep(0.2)
            sock.settimeout(10)
            assert sock.recv(1) == b""  # closed by the router, not by the 10 s socket timeout
            idle_s = time.monotonic() - answered
    finally:
        server.stop()
    assert 0.3 <= idle_s < 3.0, idle_s


def test_the_engine_gets_the_routers_header_lines_and_only_the_forwarded_client_ones(router) -> None:
    """The upstream request's header block (encoded once per request, router/proxy.py): the JSON
    content type, the request id, the body's length, the forwarded tracing/session/auth headers
    with their values byte for byte, and no other client header."""
    server, _, engines = router
    body = chat(text="headers")
    forwarded = {
        "authorization": "Bearer sk-\u00e9t\u00e9",
        "x-session-id": "conv-9",
        "x-correlation-id": "corr-1",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "tracestate": "congo=t61rcWkgMzE",
    }
    extra = b"".join(b"%s: %s\r\n" % (k.encode(), v.encode("latin-1")) for k, v in forwarded.items())
    extra += b"x-request-id: client-id-7\r\nuser-agent: ua/1\r\nx-not-forwarded: no\r\n"
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(post("/v1/chat/completions", body, extra))
        (answer,) = read_answers(sock, 1)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-request-id"] == "client-id-7"
    assert int(answer.headers["content-length"]) == len(answer.content)
    engine = next(u for u, _ in engines if u.name == answer.headers["x-kvroute-engine"])
    assert engine.bodies[-1] == body
    got = engine.headers[-1]
    for name, value in forwarded.items():
        assert got[name].encode("latin-1") == value.encode("latin-1"), name
    assert got["content-type"] == "application/json"
    assert got["x-request-id"] == "client-id-7"
    assert got["content-length"] == str(len(body))
    assert "user-agent" not in got and "x-not-forwarded" not in got
    assert set(got) == {*forwarded, "content-type", "x-request-id", "content-length", "host"}


def test_http10_gets_its_answer_and_a_closed_connection(router) -> None:
    server, _, _ = router
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(post("/v1/chat/completions", chat(), version=b"1.0"))
        (answer,) = read_answers(sock, 1)
        assert answer.status_code == 200 and answer.headers["connection"] == "close"
        sock.settimeout(30)  # a bound for a failing run; a loaded machine can take seconds
        assert sock.recv(10) == b""  # closed by the router


def test_expect_100_continue_and_a_body_in_pieces(router) -> None:
    server, _, engines = router
    body = chat(text="pieces " * 200)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        request = post("/v1/chat/completions", body, extra=b"expect: 100-continue\r\n")
        head, payload = request.split(b"\r\n\r\n", 1)
        sock.sendall(head + b"\r\n\r\n")
        sock.settimeout(30)  # a bound for a failing run; a loaded machine can take seconds
        assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue")
        for i in range(0, len(payload), 300):
            sock.sendall(payload[i : i + 300])
            time.sleep(0.01)
        (answer,) = read_answers(sock, 1)
    assert answer.status_code == 200
    assert any(b == body for upstream, _ in engines for b in upstream.bodies)


def _router_over_a_slow_stream(
    serve_asgi: Callable[..., ThreadedServer], upstreams: Any, chunks: int
) -> tuple[ThreadedServer, OpenAIUpstream]:
    """A router in front of one stand-in engine that streams ``chunks`` events 50 ms apart."""
    engines = upstreams(1)
    upstream: OpenAIUpstream = engines[0][0]
    upstream.chunks, upstream.chunk_delay_s = chunks, 0.05
    config = load_config(
        environ={},
        overrides={
            "engines": [{"id": u.name, "url": url, "model": MODEL} for u, url in engines],
            "health": {"interval_s": 0},
        },
    )
    return serve_asgi(create_app(config)), upstream


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_events_reach_the_client_while_the_engine_writes(
    serve_asgi: Callable[..., ThreadedServer], upstreams: Any, path: str
) -> None:
    """A stream is relayed as it is produced: a relay that held the events back until the end (or
    until some buffer filled) would break streaming for every client and hide a mid-stream crash
    behind a finished answer."""
    server, _ = _router_over_a_slow_stream(serve_asgi, upstreams, 40)  # a 2 s answer
    body: dict[str, Any] = {"model": MODEL, "stream": True, "max_tokens": 40}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hello"}]
    else:
        body["prompt"] = "hello"
    arrivals: list[float] = []
    with httpx.stream("POST", server.url + path, json=body, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                arrivals.append(time.monotonic())
    assert len(arrivals) >= 40
    # Relayed as they come, the events spread over the engine's ~2 s; held back, (nearly) all of
    # them would arrive within a few milliseconds at the end.
    spread = arrivals[-1] - arrivals[len(arrivals) // 4]
    assert spread > 0.5, (
        f"events arrived in a burst ({spread * 1000:.0f} ms from the first quarter to the end)"
    )


def test_client_gone_mid_stream_cancels_the_engine_and_counts_499(
    serve_asgi: Callable[..., ThreadedServer], upstreams: Any
) -> None:
    server, upstream = _router_over_a_slow_stream(serve_asgi, upstreams, 50)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(post("/v1/chat/completions", chat(stream=True)))
        sock.settimeout(30)  # a bound for a failing run; a loaded machine can take seconds
        seen = b""
        while b"data:" not in seen:  # the upstream sends a keep-alive comment first
            more = sock.recv(65536)
            assert more, seen
            seen += more
    deadline = time.monotonic() + 10
    metrics = ""
    while time.monotonic() < deadline:
        metrics = httpx.get(server.url + "/metrics").text
        if upstream.cancelled_streams and 'status="499"' in metrics:
            break
        time.sleep(0.05)
    assert upstream.cancelled_streams == 1
    assert 'status="499"' in metrics


async def test_due_calls_run_in_due_order_on_one_timer() -> None:
    """The non-stream prefill releases share one loop timer: an item due earlier than the armed
    one re-arms it, items run in due order, none is lost, and a failing call does not stop the rest."""
    import asyncio

    from router.routing import _DueCalls

    done: list[str] = []
    all_done = asyncio.Event()

    def call(item: str) -> None:
        if item == "bad":
            raise ValueError("boom")
        done.append(item)
        if len(done) == 3:
            all_done.set()

    calls = _DueCalls(call, slack_s=0.0)
    calls.add(0.06, "third")
    calls.add(0.02, "first")  # earlier than the armed timer: re-armed
    calls.add(0.04, "bad")
    calls.add(0.05, "second")
    await asyncio.wait_for(all_done.wait(), 5)
    assert done == ["first", "second", "third"]
    assert calls._timer is None and not calls._heap


def test_due_calls_run_on_a_new_loop_after_the_old_one_stopped() -> None:
    """``_DueCalls`` keeps its loop (no getpid per add) but takes the running one when the kept
    loop stopped: items added in a second ``asyncio.run`` still run."""
    import asyncio

    from router.routing import _DueCalls

    ran: list[int] = []
    done: list[asyncio.Event] = []

    def call(item: int) -> None:
        ran.append(item)
        done[-1].set()

    due = _DueCalls(call, slack_s=0.0)

    async def add_and_wait(item: int) -> None:
        done.append(asyncio.Event())
        due.add(0.0, item)
        await done[-1].wait()

    asyncio.run(asyncio.wait_for(add_and_wait(1), 5))
    asyncio.run(asyncio.wait_for(add_and_wait(2), 5))
    assert ran == [1, 2]


@pytest.mark.parametrize("splice", ["none", "priority", "tenant"])
def test_a_16k_token_body_reaches_the_engine_byte_for_byte_with_each_splice(
    serve_asgi: Callable[..., ThreadedServer], upstreams: Any, splice: str
) -> None:
    """A 16K-token chat body (longer than the guard's header budget) sent in one write and in
    pieces (cut inside the blank line that ends the headers, and in the body), streamed and not:
    the engine gets the client's bytes, with only the router's own splices (the usage request of a
    stream, a priority engine's priority, the tenant's cache_salt) and nothing else changed."""
    engines = upstreams(1)
    overrides: dict[str, Any] = {
        "engines": [{"id": u.name, "url": url, "model": MODEL} for u, url in engines],
        "health": {"interval_s": 0},
        "policy": {"name": "round_robin"},
    }
    if splice == "priority":
        overrides["engines"][0]["scheduling_policy"] = "priority"
    if splice == "tenant":
        overrides["tenancy"] = {"source": "header", "header": "x-tenant-id"}
    server = serve_asgi(create_app(load_config(environ={}, overrides=overrides)))
    engine = engines[0][0]
    text = "word " * 16_000 + '\u00e9"\\ end'  # escapes and a non-ASCII character in it too
    for stream in (False, True):
        body = chat(stream=stream, text=text)
        assert len(body) > 64 * 1024
        expected = body
        if splice == "tenant":
            salt = "t-" + hashlib.sha256(b"acme").hexdigest()[:32]
            salted = {**json.loads(body), "cache_salt": salt}
            expected = json.dumps(salted, separators=(",", ":"), ensure_ascii=False).encode()
        if stream:
            expected = b'{"stream_options":{"include_usage":true},' + expected[1:]
        request = post("/v1/chat/completions", body, b"x-tenant-id: acme\r\n")
        end = request.index(b"\r\n\r\n")
        for cuts in ((), (end + 2, end + 1000)):
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                start = 0
                for cut in cuts:
                    sock.sendall(request[start:cut])
                    time.sleep(0.05)  # (so that the router reads the pieces apart)
                    start = cut
                sock.sendall(request[start:])
                (answer,) = read_answers(sock, 1)
            assert answer.status_code == 200, answer.text
            got = engine.bodies[-1]
            if splice == "priority":
                match = re.match(rb'\{"priority":-?\d+,', got)
                assert match is not None, got[:80]
                got = b"{" + got[match.end() :]
            assert got == expected, (stream, cuts, got[:120], expected[:120])
