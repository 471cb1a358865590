"""Inputs that used to crash or stall the router, a reset pooled connection, a slow /health, drained
fleets and byte-bounded memory: each against real HTTP servers on loopback (issue 13 items 3, 4, 6,
7, 8, 10, 12)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from router.app import create_app
from router.config import load_config
from router.experiments import Experiments
from router.tokenize import SimChatTokenizer
from tests.conftest import ThreadedServer
from tests.test_app_errors import dead_url

MODEL = "test-model"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}


def router_for(serve_asgi: Callable[..., ThreadedServer], urls: list[tuple[str, str]], **sections: Any):
    data: dict[str, Any] = {
        "engines": [{"id": eid, "url": url, "model": MODEL} for eid, url in urls],
        "policy": {"name": "round_robin"},
        "health": {"interval_s": 0},
        **sections,
    }
    return serve_asgi(create_app(load_config(environ={}, overrides=data)))


@pytest.fixture
def one_engine(serve_asgi, upstreams):
    ((upstream, url),) = upstreams(1)
    return upstream, router_for(serve_asgi, [("e0", url)], limits={"max_body_bytes": 65536})


# -- item 6: no 500 from the router's own code, keep-alive survives errors ----------------------


def test_bad_bodies_are_400_and_the_keep_alive_connection_survives(one_engine) -> None:
    upstream, router = one_engine
    text_not_string = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}],
    }
    nested = b'{"model": "test-model", "messages": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    good = {"model": MODEL, "messages": MESSAGES}
    statuses = []
    with httpx.Client(base_url=router.url, timeout=10) as client:
        for body in (text_not_string, good, nested, good, text_not_string, good):
            raw = body if isinstance(body, bytes) else httpx.Request("POST", "/", json=body).content
            resp = client.post(CHAT, content=raw, headers=JSON)
            statuses.append(resp.status_code)
            if resp.status_code != 200:
                assert resp.json()["error"]["code"] in ("invalid_type", "invalid_json")
    assert statuses == [400, 200, 400, 200, 400, 200]
    assert len(upstream.bodies) == 3  # only the good ones reached the engine


def test_out_of_range_values_are_rejected_like_the_engine_would(one_engine) -> None:
    upstream, router = one_engine
    for extra in ({"max_tokens": 0}, {"n": 0}, {"temperature": -1}, {"top_p": 2}, {"cache_salt": ""}):
        resp = httpx.post(router.url + CHAT, json={"model": MODEL, "messages": MESSAGES, **extra})
        assert resp.status_code == 400, extra
    assert upstream.bodies == []


# -- item 7 / 10: limits, content type, clipped echoes -----------------------------------------


def test_explain_has_the_chat_paths_limits_and_validation(serve_asgi, upstreams) -> None:
    from router.service import build_router_app

    ((_, url),) = upstreams(1)
    config = load_config(
        environ={},
        overrides={
            "engines": [{"id": "e0", "url": url, "model": MODEL}],
            "health": {"interval_s": 0},
            "index": {"enabled": False},
            "costs": {"scrape_interval_s": 0},
            "tokenizer": {"backend": "sim"},
            "limits": {"max_body_bytes": 65536},
        },
    )
    router = serve_asgi(build_router_app(config))
    explain = router.url + "/v1/route/explain"
    ok = httpx.post(explain, json={"model": MODEL, "messages": MESSAGES})
    assert ok.status_code == 200 and ok.json()["choice"] == "e0"
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 70000}]}
    assert httpx.post(explain, json=big).json()["error"]["code"] == "request_too_large"
    bad = httpx.post(explain, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 0})
    assert bad.status_code == 400
    plain = httpx.post(
        explain, content=b'{"model": "test-model", "prompt": "x"}', headers={"content-type": "text/plain"}
    )
    assert plain.status_code == 415


def test_non_json_content_types_are_415_and_never_reach_an_engine(one_engine) -> None:
    upstream, router = one_engine
    body = b'{"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}'
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None):
        headers = {"content-type": content_type} if content_type else {}
        resp = httpx.post(router.url + CHAT, content=body, headers=headers)
        assert resp.status_code == 415
        assert resp.json()["error"]["code"] == "unsupported_media_type"
    ok = httpx.post(
        router.url + CHAT, content=body, headers={"content-type": "application/json; charset=utf-8"}
    )
    assert ok.status_code == 200
    assert len(upstream.bodies) == 1


def test_prompt_limit_applies_before_any_tokenising(serve_asgi, upstreams) -> None:
    ((upstream, url),) = upstreams(1)
    router = router_for(serve_asgi, [("e0", url)], limits={"max_prompt_tokens": 1000})
    long_prompt = {"model": MODEL, "prompt": "word " * 1000}  # ~1,250 tokens at 4 chars per token
    resp = httpx.post(router.url + "/v1/completions", json=long_prompt)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "prompt_too_long"
    token_ids = {"model": MODEL, "prompt": list(range(1001))}
    assert httpx.post(router.url + "/v1/completions", json=token_ids).status_code == 400
    assert upstream.bodies == []
    assert (
        httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}).status_code == 200
    )


def test_unknown_model_name_and_request_id_are_not_echoed_whole(one_engine, caplog) -> None:
    _, router = one_engine
    name = "m" * 50_000
    resp = httpx.post(
        router.url + CHAT, json={"model": name, "messages": MESSAGES}, headers={"x-request-id": "r" * 5000}
    )
    assert resp.status_code == 404
    assert len(resp.text) < 1000 and "characters, clipped" in resp.json()["error"]["message"]
    assert len(resp.headers["x-request-id"]) < 64
    assert all(len(r.getMessage()) < 2000 for r in caplog.records)


# -- item 3: a reset pooled connection is retried like a refused one ---------------------------


@pytest.fixture
def resetting_engine() -> Iterator[str]:
    """An 'engine' that reads each request and answers with a TCP reset (a dying keep-alive socket)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    stop = threading.Event()

    def serve() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            conn.recv(65536)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    thread.join(2)
    sock.close()


def test_connection_reset_before_any_answer_fails_over(serve_asgi, upstreams, resetting_engine) -> None:
    ((upstream, url),) = upstreams(1)
    router = router_for(serve_asgi, [("rst", resetting_engine), ("e0", url)])  # round robin: rst first
    resp = httpx.post(router.url + CHAT, json={"model": MODEL, "messages": MESSAGES})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvroute-engine"] == "e0"
    assert len(upstream.bodies) == 1
    text = httpx.get(router.url + "/metrics").text
    assert 'kvroute_upstream_errors_total{engine="rst",kind="connect"} 1.0' in text


@pytest.fixture
def engine_dropping_idle_sockets() -> Iterator[str]:
    """An 'engine' that answers the first request of each connection (keep-alive) and resets the
    connection when a second request comes on it: a pooled socket it had already given up on."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    stop = threading.Event()
    answer = b'{"id": "x", "object": "chat.completion", "choices": [], "usage": {"prompt_tokens": 1}}'

    def handle(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, rest = data.partition(b"\r\n\r\n")
            length = int(
                next(
                    v
                    for k, _, v in (line.partition(b":") for line in head.split(b"\r\n"))
                    if k.strip().lower() == b"content-length"
                )
            )
            while len(rest) < length:
                rest += conn.recv(65536)
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(answer), answer)
            )
            with contextlib.suppress(OSError):
                conn.recv(65536)  # the next request on this socket: reset, no answer
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def serve() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    thread.join(2)
    sock.close()


def test_a_dead_pooled_connection_is_retried_on_a_fresh_one_and_is_no_engine_failure(
    serve_asgi, engine_dropping_idle_sockets
) -> None:
    """Issue 28 item 6: one reset on a pooled keep-alive socket marked the engine unhealthy (and,
    with no other engine, answered 502); it is retried on a new connection instead."""
    router = router_for(serve_asgi, [("e0", engine_dropping_idle_sockets)], health={"interval_s": 0})
    with httpx.Client(base_url=router.url, timeout=30) as client:
        for _ in range(4):
            resp = client.post(CHAT, json={"model": MODEL, "messages": MESSAGES})
            assert resp.status_code == 200, resp.text
        ready = client.get("/ready").json()
        assert ready["engines"]["e0"]["healthy"] is True
        assert 'kvroute_upstream_errors_total{engine="e0"' not in client.get("/metrics").text


# -- item 4: one slow /health is not death ------------------------------------------------------


class SlowHealthEngine:
    """Answers chat at once but GET /health only after ``health_delay_s``; counts the polls."""

    def __init__(self, health_delay_s: float) -> None:
        self.health_delay_s = health_delay_s
        self.requests = 0
        self.health_polls = 0

    def app(self) -> Starlette:
        async def health(request: Request) -> Response:
            self.health_polls += 1
            await asyncio.sleep(self.health_delay_s)
            return Response()

        async def chat(request: Request) -> Response:
            await request.body()
            self.requests += 1
            return JSONResponse({"id": "x", "object": "chat.completion", "choices": [], "usage": None})

        return Starlette(routes=[Route("/health", health), Route(CHAT, chat, methods=["POST"])])


def test_slow_health_does_not_mark_a_serving_engine_dead(serve_asgi) -> None:
    # /health answers at once until the engine has answered a request: on a busy machine the first
    # answer can come later than three failed polls, and an engine out of routing answers none.
    engine = SlowHealthEngine(health_delay_s=0.0)
    server = serve_asgi(engine.app())
    router = router_for(
        serve_asgi,
        [("e0", server.url)],
        health={
            "interval_s": 0.1,
            "timeout_s": 0.2,
            "failures_before_unhealthy": 3,
            "answer_liveness_s": 10.0,
        },
    )
    statuses = [httpx.post(router.url + CHAT, json={"model": MODEL, "messages": MESSAGES}).status_code]
    assert statuses == [200]
    engine.health_delay_s = 1.0
    # Serve until at least 5 polls failed (the 7th slow poll starts after the 5th failed): past
    # failures_before_unhealthy, the engine is kept only because it keeps answering.
    polls = engine.health_polls + 7
    deadline = time.monotonic() + 60
    while engine.health_polls < polls:
        assert time.monotonic() < deadline, f"only {engine.health_polls} polls in 60 s"
        statuses.append(
            httpx.post(router.url + CHAT, json={"model": MODEL, "messages": MESSAGES}).status_code
        )
        time.sleep(0.05)
    assert set(statuses) == {200}
    assert engine.requests == len(statuses)
    # No traffic: the failed polls alone take it out once the last answer is old enough.
    engine.health_delay_s = 1.0
    router2 = router_for(
        serve_asgi,
        [("e0", server.url)],
        health={
            "interval_s": 0.1,
            "timeout_s": 0.2,
            "failures_before_unhealthy": 3,
            "answer_liveness_s": 0.5,
        },
    )
    deadline = time.monotonic() + 60
    while httpx.get(router2.url + "/ready").status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    ready = httpx.get(router2.url + "/ready").json()
    assert not ready["engines"]["e0"]["healthy"] and "in a row" in ready["engines"]["e0"]["error"]


# -- item 12: /ready with a drained fleet, undrain ----------------------------------------------


def test_ready_is_false_when_every_engine_is_drained_and_undrain_restores(serve_asgi, upstreams) -> None:
    from router.service import build_router_app

    ((_, url),) = upstreams(1)
    config = load_config(
        environ={},
        overrides={
            "engines": [{"id": "e0", "url": url, "model": MODEL}],
            "health": {"interval_s": 0},
            "index": {"enabled": False},
            "costs": {"scrape_interval_s": 0},
            "admin": {"token": "admin-token-123456"},
        },
    )
    router = serve_asgi(build_router_app(config))
    admin = {"authorization": "Bearer admin-token-123456"}
    assert httpx.get(router.url + "/ready").status_code == 200
    assert httpx.post(router.url + "/admin/engines/e0/drain", headers=admin).status_code == 200
    ready = httpx.get(router.url + "/ready")
    assert ready.status_code == 503 and ready.json()["engines"]["e0"]["drained"]
    assert httpx.post(router.url + CHAT, json={"model": MODEL, "messages": MESSAGES}).status_code == 503
    assert httpx.post(router.url + "/admin/engines/e0/undrain", headers=admin).status_code == 200
    assert httpx.get(router.url + "/ready").status_code == 200
    assert httpx.post(router.url + CHAT, json={"model": MODEL, "messages": MESSAGES}).status_code == 200


# -- item 8: memory bounded by bytes --------------------------------------------------------------


def test_tokenizer_prefix_cache_is_bounded_in_bytes() -> None:
    bound_bytes = 1024 * 1024
    tok = SimChatTokenizer(cache_max_bytes=bound_bytes)

    async def feed() -> None:
        for i in range(8):  # 8 conversations of ~40 KB (~490 KB of token lists each when cached)
            messages = [{"role": "user", "content": f"conversation {i} " + "lorem ipsum " * 3400}]
            await tok.chat_tokens(messages)

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        asyncio.run(feed())
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    stats = tok.cache_stats()
    assert stats["bytes"] <= bound_bytes and 0 < stats["entries"] < 8
    # Independent truth: what the interpreter really holds, not the cache's own estimate.
    assert grown < 2 * bound_bytes


def test_experiment_session_map_does_not_keep_huge_keys() -> None:
    experiments = Experiments({"policy": "round_robin"})
    experiments.bound_sessions(64 * 1024)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(30):
            experiments.assign(f"{i}" + "u" * 1_000_000)  # a 1 MB ``user`` value each
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert experiments.session_count() == 30
    assert grown < 64 * 1024
    for i in range(2000):
        experiments.assign(f"s{i}")
    assert experiments.session_count() <= 64 * 1024 // 144


def test_a_half_open_breaker_lets_one_trial_request_through() -> None:
    """Issue 28 item 6: after breaker_open_s the breaker let every request through at once; now one
    trial goes, the others keep away until it succeeds, fails, or outlives breaker_open_s."""
    from router.config import EngineConfig
    from router.load import LoadTracker

    tracker = LoadTracker([EngineConfig(id="e0", url="http://127.0.0.1:1")])
    tracker.configure_breaker(3, 5.0)
    state = tracker.engines["e0"]
    for _ in range(3):
        tracker.record_failure("e0", "refused", now_s=100.0)
    assert tracker.breaker_open(state, 104.9)
    assert not tracker.breaker_open(state, 105.1)  # half-open: a trial may go
    tracker.claim_trial("e0", now_s=105.1)
    assert tracker.breaker_open(state, 105.2)  # ... and only one
    tracker.claim_trial("e0", now_s=105.2)
    assert tracker.breaker_open(state, 110.0)
    assert not tracker.breaker_open(state, 110.2)  # the trial never reported: another may go
    tracker.claim_trial("e0", now_s=110.2)
    tracker.record_failure("e0", "refused", now_s=111.0)  # the trial failed: open again
    assert tracker.breaker_open(state, 115.9) and not tracker.breaker_open(state, 116.1)
    tracker.claim_trial("e0", now_s=116.1)
    tracker.record_success("e0")  # the trial answered: closed, everyone goes
    assert not tracker.breaker_open(state, 116.2)
    tracker.claim_trial("e0", now_s=116.2)
    assert not tracker.breaker_open(state, 116.3)


def _held_trial(
    server: ThreadedServer, upstream: Any, half_open: str, tried_first: str | None = None
) -> None:
    """Opens ``half_open``'s breaker an hour ago (half-open now), sends one chat request and holds
    it at ``upstream`` (that engine): while it is held the breaker must count as open (the trial
    is out: nobody else goes there); its answer must close it. ``tried_first``: an engine the
    request must have failed on before (a fail-over)."""
    tracker = server.server.config.app.state.tracker
    state = tracker.engines[half_open]
    tracker.record_failure(half_open, "refused", now_s=time.monotonic() - 3600)
    assert state.breaker_open_until_s and not tracker.breaker_open(state, time.monotonic())  # half-open
    upstream.delay_s = 60.0  # the trial is held at the engine until the test lets it go
    answers: list[int] = []
    trial = threading.Thread(
        target=lambda: answers.append(
            httpx.post(server.url + CHAT, json={"model": MODEL, "messages": MESSAGES}, timeout=60).status_code
        )
    )
    trial.start()
    try:
        deadline = time.monotonic() + 30
        while not upstream.bodies and time.monotonic() < deadline:
            time.sleep(0.01)
        assert upstream.bodies, "the trial request never reached the half-open engine"
        if tried_first is not None:
            assert tracker.engines[tried_first].breaker_failures, (
                f"the request did not try {tried_first} first"
            )
        assert tracker.breaker_open(state, time.monotonic())  # the trial is out: nobody else goes
    finally:
        upstream.delay_s = 0.0
        trial.join(timeout=30)
    assert answers == [200]
    # The answer's accounting (the liveness observer closing the breaker) runs after its write:
    # the client can hold the answer first, so wait for the close.
    deadline = time.monotonic() + 30
    while state.breaker_open_until_s and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not state.breaker_open_until_s and not tracker.breaker_open(state, time.monotonic())


def test_the_router_claims_a_half_open_breakers_trial_when_it_routes_there(serve_asgi, upstreams) -> None:
    """The wiring, not the tracker alone: the request routed to a half-open engine is its one trial
    (the breaker counts as open while it is out) and its answer closes the breaker. Before the fix
    the liveness observer claimed the trial for ``ctx.engine_id``, still empty when ``on_routed``
    runs, so a half-open engine took every request."""
    ((upstream, url),) = upstreams(1)
    server = router_for(serve_asgi, [("e0", url)], health={"interval_s": 0, "breaker_failures": 1})
    _held_trial(server, upstream, "e0")


def test_a_fail_over_to_a_half_open_engine_claims_its_trial(serve_asgi, upstreams) -> None:
    """The second attempt of a request (its first engine refused) is a trial too when it lands on a
    half-open engine: routing notifies ``on_routed`` once, for the first choice, so before the fix
    the fail-over's engine took its request without claiming the trial and stayed open to all."""
    ((upstream, url),) = upstreams(1)
    # round_robin's first request goes to e0 (nothing listens), then fails over to e1
    server = router_for(
        serve_asgi, [("e0", dead_url()), ("e1", url)], health={"interval_s": 0, "breaker_failures": 1}
    )
    _held_trial(server, upstream, "e1", tried_first="e0")
