"""The per-request shortcuts of the proxied path keep its rules: the model check without a fleet
scan, observers' empty hooks skipped (and only those), a body that came whole taken from the
exchange within the size limit and the 100-continue rule, and tier_cost's parts handed to the core
unchanged. Real sockets, real uvicorn, real upstreams."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from typing import Any

import httpx

from kvcore.calibration import CostModel
from kvcore.core import CoreConfig, InMemoryLoadLedger, RoutingCore
from policies.base import EngineView, PrefixMatch, RouteRequest
from policies.costs import PredictedParts
from policies.tier_cost import TierCostPolicy
from router.app import create_app
from router.config import load_config
from router.routing import RouteContext, does_nothing
from tests.conftest import ThreadedServer
from tests.test_fastpath import post, read_answers

MODEL = "test-model"
CHAT = "/v1/chat/completions"
JSON = {"content-type": "application/json"}


def chat(model: str = MODEL, text: str = "hi") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 3}


class RecordingAnnotator:
    """Counts the requests it was asked to annotate (it adds no keys)."""

    def __init__(self) -> None:
        self.calls = 0

    async def annotate(self, ctx: RouteContext) -> None:
        self.calls += 1


class CountingObserver:
    """One empty hook of each written form, and one that counts."""

    def __init__(self) -> None:
        self.finished = 0
        self.calls = threading.Semaphore(0)  # one release per on_finished, from the server's thread

    def on_routed(self, ctx: RouteContext) -> None:
        return None

    def on_first_byte(self, ctx: RouteContext) -> None:
        """Nothing to do at the first byte."""

    def on_finished(self, ctx: RouteContext) -> None:
        self.finished += 1
        self.calls.release()


def serve(
    serve_asgi: Callable[..., ThreadedServer], urls: list[str], **kwargs: Any
) -> tuple[ThreadedServer, Any]:
    overrides = kwargs.pop("overrides", {})
    config = load_config(
        environ={},
        overrides={
            "engines": [{"id": f"e{i}", "url": url, "model": MODEL} for i, url in enumerate(urls)],
            "policy": {"name": "round_robin"},
            "health": {"interval_s": 0},
            **overrides,
        },
    )
    app = create_app(config, **kwargs)
    return serve_asgi(app), app


def test_an_unknown_model_is_404_before_any_annotation_a_known_one_annotated(serve_asgi, upstreams) -> None:
    # Catches: the model check moved behind the candidate filter answering 503 (or tokenising) for
    # a model no engine serves, or skipping the annotator for a served one.
    ((_, url),) = upstreams(1)
    annotator = RecordingAnnotator()
    server, _ = serve(serve_asgi, [url], annotator=annotator)
    unknown = httpx.post(server.url + CHAT, json=chat(model="nope"))
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert annotator.calls == 0
    assert httpx.post(server.url + CHAT, json=chat()).status_code == 200
    assert annotator.calls == 1


def test_a_known_model_on_an_unhealthy_fleet_is_still_503(serve_asgi, upstreams) -> None:
    # Catches: an empty candidate list taken for an unknown model (404 instead of 503).
    ((_, url),) = upstreams(1)
    server, app = serve(serve_asgi, [url])
    app.state.tracker.set_health("e0", False, "down for the test")
    answer = httpx.post(server.url + CHAT, json=chat())
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_healthy_engine"


def test_empty_observer_hooks_are_skipped_and_the_others_called(serve_asgi, upstreams) -> None:
    # Catches: a hook with a body taken for an empty one (an observer silently fed nothing).
    observer = CountingObserver()
    assert does_nothing(observer.on_routed) and does_nothing(observer.on_first_byte)
    assert not does_nothing(observer.on_finished)
    ((_, url),) = upstreams(1)
    server, app = serve(serve_asgi, [url], observers=[observer])
    hooks = app.state.router._hooks
    assert all(o is not observer for o, _ in hooks["on_routed"] + hooks["on_first_byte"])
    assert any(o is observer for o, _ in hooks["on_finished"])
    for _ in range(3):
        assert httpx.post(server.url + CHAT, json=chat()).status_code == 200
    # The accounting runs right after the answer's write (round dp21): the client can hold its
    # answer before the hook has run, so wait for each call, then check none came extra.
    assert all(observer.calls.acquire(timeout=30) for _ in range(3))
    assert observer.finished == 3
    metrics = httpx.get(server.url + "/metrics").text
    assert (
        'kvroute_requests_total{arm="default",engine="e0",policy="round_robin",status="200"} 3.0' in metrics
    )


def test_a_whole_chunked_body_over_the_limit_is_413(serve_asgi, upstreams) -> None:
    # Catches: the whole-body shortcut skipping limits.max_body_bytes (a chunked body declares no
    # length, so only the read can refuse it).
    ((upstream, url),) = upstreams(1)
    server, _ = serve(serve_asgi, [url], overrides={"limits": {"max_body_bytes": 2048}})
    body = json.dumps(chat(text="x" * 4000)).encode()
    request = (
        b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (CHAT.encode(), len(body), body)
    )
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request)
        (answer,) = read_answers(sock, 1)
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "request_too_large"
    assert upstream.bodies == []
    small = httpx.post(server.url + CHAT, json=chat())
    assert small.status_code == 200 and len(upstream.bodies) == 1


def test_a_body_sent_with_expect_100_still_gets_its_continue(serve_asgi, upstreams) -> None:
    # Catches: the whole-body shortcut dropping the 100 Continue the exchange owes the client.
    ((upstream, url),) = upstreams(1)
    server, _ = serve(serve_asgi, [url])
    body = json.dumps(chat()).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(post(CHAT, body, extra=b"expect: 100-continue\r\n"))
        sock.settimeout(30)  # a bound for a failing run; a loaded machine can take seconds
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(100)
        assert data.startswith(b"HTTP/1.1 100 Continue")
        # The answer may follow in the same read: what comes after the interim head is its start.
        (answer,) = read_answers(sock, 1, pending=data.split(b"\r\n\r\n", 1)[1])
    assert answer.status_code == 200 and upstream.bodies == [body]


def test_tier_cost_parts_reach_the_reservation_as_priced() -> None:
    # Catches: the core pricing a tier_cost choice again (or from other numbers) instead of using
    # the parts the policy compared: the reservation's parts must be the decision's, and equal to
    # what its scores say.
    ledger = InMemoryLoadLedger(["a", "b"])
    core = RoutingCore(ledger=ledger, costs=CostModel(), config=CoreConfig(speculation_ttl_s=0.0))
    ledger.reserve("a", 500)
    request = RouteRequest(
        request_id="r1",
        model=MODEL,
        session_key="s",
        prompt_tokens=1000,
        block_size=16,
        prefix_matches={"b": PrefixMatch(blocks=20, blocks_by_tier=(12, 8, 0))},
    )
    policy = TierCostPolicy()
    candidates = core.filter(request, [EngineView("a"), EngineView("b")], uses_index=True)
    decision = core.score(policy, request, candidates, now=0.0)
    assert decision.parts is not None and set(decision.parts) == {"a", "b"}
    reservation = core.reserve(policy, request, decision, 0.0, candidates=candidates)
    assert reservation.parts is decision.parts[decision.engine_id]
    assert reservation.parts == PredictedParts.from_scores(decision.scores[decision.engine_id])
    fallback = decision.fallbacks[0]
    retry = core.reserve(policy, request, decision, 0.0, engine_id=fallback, candidates=candidates)
    assert retry.parts is decision.parts[fallback]


def test_parity_window_counts_follow_the_window_rule() -> None:
    # Catches: the running mismatch count drifting from the window (a sample leaving the window
    # not subtracted, or subtracted twice): distrust set or lifted at the wrong request.
    import random

    from router.parity import PromptParity

    rng = random.Random(7)
    parity = PromptParity(tail_tokens=2, window=8, min_mismatches=4)
    window: list[bool] = []
    distrusted = False
    for step in range(5000):
        # Runs of agreement and disagreement, so distrust is both set and lifted many times.
        mismatch = rng.random() < (0.7 if (step // 200) % 2 else 0.05)
        router_tokens = 100
        parity.observe("e0", router_tokens, router_tokens + (9 if mismatch else rng.randint(-2, 2)))
        window = [*window, mismatch][-8:]
        if not distrusted and sum(window) >= 4:
            distrusted = True
        elif distrusted and not any(window) and len(window) == 8:
            distrusted = False
        assert parity.distrusts("e0") is distrusted, step


def test_finished_requests_are_counted_in_bulk_and_every_scrape_sees_them_all() -> None:
    """RouterMetrics keeps a finished request as one tuple and folds them every FOLD_EVERY
    requests; a scrape in between folds the rest first, so /metrics is never behind."""
    from router.metrics import FOLD_EVERY, RouterMetrics

    metrics = RouterMetrics()

    def finish(status: int, latency_s: float) -> None:
        ctx = RouteContext(
            request_id="r",
            endpoint="chat",
            raw_body=b"{}",
            body={},
            stream=False,
            route_request=RouteRequest("r"),
            started_s=10.0,
            arm="default",
            policy_name="round_robin",
            engine_id="e0",
            sent_s=10.0002,
            finished_s=10.0 + latency_s,
            http_status=status,
        )
        metrics.on_finished(ctx)

    def scraped(name: str, **labels: str) -> float:
        value = metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    for _ in range(FOLD_EVERY + 10):  # one bulk fold and 10 left over
        finish(200, 0.003)
    finish(502, 0.5)
    engine = {"engine": "e0", "policy": "round_robin", "arm": "default"}
    assert scraped("kvroute_requests_total", **engine, status="200") == FOLD_EVERY + 10
    assert scraped("kvroute_requests_total", **engine, status="502") == 1
    assert scraped("kvroute_request_latency_seconds_count", **engine) == FOLD_EVERY + 11
    assert scraped("kvroute_request_latency_seconds_bucket", **engine, le="0.005") == FOLD_EVERY + 10
    latency_sum = scraped("kvroute_request_latency_seconds_sum", **engine)
    assert abs(latency_sum - (0.003 * (FOLD_EVERY + 10) + 0.5)) < 1e-9
    assert scraped("kvroute_router_seconds_bucket", arm="default", le="0.00025") == FOLD_EVERY + 11
    finish(200, 0.003)  # after a scrape: counted by the next one
    assert scraped("kvroute_requests_total", **engine, status="200") == FOLD_EVERY + 11
