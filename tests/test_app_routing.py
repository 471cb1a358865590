"""Pipeline pieces without sockets: request parsing, session keys, usage parsing, arms, load."""

from __future__ import annotations

import json
from collections import Counter

import msgspec
import pytest

from kvcore.calibration import CostModel
from kvcore.core import RoutingCore
from policies.base import RouteRequest
from router.config import EngineConfig, RouterConfig
from router.errors import RouterError
from router.load import LoadTracker
from router.metrics import create_metrics
from router.routing import (
    CHAT,
    COMPLETIONS,
    build_arm_selector,
    parse_request,
    session_key_of,
    usage_from_stream_tail,
)


def parse(endpoint: str, body: dict, headers: dict | None = None):
    return parse_request(
        endpoint,
        json.dumps(body).encode(),
        headers or {},
        request_id="r1",
        started_s=0.0,
        config=RouterConfig(),
    )


def test_session_key_precedence_header_user_hash() -> None:
    body = {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}
    assert session_key_of(CHAT, {**body, "user": "u1"}, {"x-session-id": "h1"}) == "h1"
    assert session_key_of(CHAT, {**body, "user": "u1"}, {}) == "u1"
    hashed = session_key_of(CHAT, body, {})
    # Later turns resend the same first two messages: same key.
    later = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "a"}]}
    assert session_key_of(CHAT, later, {}) == hashed
    other = {**body, "messages": [body["messages"][0], {"role": "user", "content": "other"}]}
    assert session_key_of(CHAT, other, {}) != hashed
    assert session_key_of(COMPLETIONS, {"prompt": "abc" * 200}, {}) == session_key_of(
        COMPLETIONS, {"prompt": "abc" * 300}, {}
    )


def test_session_key_of_a_start_with_integers_beyond_64_bits_is_stable_and_distinct() -> None:
    def key(big: int) -> str:
        return session_key_of(
            CHAT, {"model": "m", "messages": [{"role": "user", "content": "q", "x": big}]}, {}
        )

    assert key(2**64) == key(2**64)
    assert len({key(2**64), key(2**64 + 1), key(-(2**63) - 1), key(1)}) == 4


def test_parse_builds_route_request() -> None:
    ctx = parse(CHAT, {"model": "m", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 9})
    request = ctx.route_request
    assert (request.model, request.request_id, request.expected_output_tokens) == ("m", "r1", 9)
    assert request.prompt_tokens == 100 + 4  # 400 chars / 4 per token + 4 per message
    assert not ctx.stream
    tokens = parse(COMPLETIONS, {"model": "m", "prompt": list(range(33)), "stream": True})
    assert tokens.route_request.prompt_tokens == 33 and tokens.stream
    assert tokens.route_request.expected_output_tokens == 256  # limits.default_output_tokens


@pytest.mark.parametrize("prompt", [[], [1.5], [[1], "a"], {"a": 1}, True])
def test_parse_rejects_bad_prompts(prompt) -> None:
    with pytest.raises(RouterError) as info:
        parse(COMPLETIONS, {"model": "m", "prompt": prompt})
    assert info.value.status == 400 and info.value.code == "invalid_type"


def test_usage_from_stream_tail() -> None:
    usage = {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 3}}
    tail = (
        b'ens": 1}}]}\n\ndata: {"choices": [{"delta": {}}]}\n\n'
        + b"data: "
        + json.dumps({"choices": [], "usage": usage}).encode()
        + b"\n\ndata: [DONE]\n\n"
    )
    assert usage_from_stream_tail(tail) == usage
    assert usage_from_stream_tail(b'data: {"usage": null}\n\ndata: [DONE]\n\n') is None
    assert usage_from_stream_tail(b'sage": {"prompt_tokens": 1}}\n\n') is None  # cut in half


def test_weighted_arms_are_sticky_and_weighted() -> None:
    config = msgspec.convert(
        {
            "experiment": {
                "arms": [
                    {"name": "a", "policy": "round_robin", "weight": 3.0},
                    {"name": "b", "policy": "least_loaded", "weight": 1.0},
                ]
            }
        },
        RouterConfig,
    )
    selector = build_arm_selector(config)  # router.experiments.Experiments, the one arm selector
    picks = {f"s{i}": selector.select(f"s{i}").name for i in range(4000)}
    assert all(selector.select(k).name == v for k, v in list(picks.items())[:200])
    share_a = Counter(picks.values())["a"] / len(picks)
    assert 0.70 < share_a < 0.80
    assert build_arm_selector(RouterConfig()).select("x").name == "default"


def test_load_tracker_ledger_and_core_filter() -> None:
    metrics = create_metrics()
    tracker = LoadTracker(
        [
            EngineConfig(id="a", url="http://a:1", model="m"),
            EngineConfig(id="b", url="http://b:1", model="other"),
            EngineConfig(id="c", url="http://c:1"),  # model unknown: candidate for any model
        ],
        metrics,
    )
    core = RoutingCore(ledger=tracker.ledger, costs=CostModel())
    request = RouteRequest("r", model="m")
    ticket = tracker.ledger.reserve("a", 1000)
    second = tracker.ledger.reserve("a", 500)
    view = {v.engine_id: v for v in core.filter(request, tracker.all_views())}
    assert set(view) == {"a", "c"}
    assert (view["a"].in_flight, view["a"].queued_prefill_tokens) == (2, 1500)
    assert 'kvroute_in_flight{engine="a"} 2.0' in metrics.render().decode()
    tracker.ledger.first_token(ticket)
    tracker.ledger.first_token(ticket)  # idempotent
    assert tracker.load("a") == (2, 500)
    tracker.ledger.finish(ticket)
    tracker.ledger.finish(ticket)
    tracker.ledger.finish(second)  # ends without a first token: its prefill share goes too
    assert tracker.load("a") == (0, 0)
    tracker.set_health("a", False, "refused")
    assert [v.engine_id for v in core.filter(request, tracker.all_views())] == ["c"]
    tracker.set_health("a", True)
    tracker.drain("c")
    assert [v.engine_id for v in core.filter(request, tracker.all_views())] == ["a"]
    assert [s.config.id for s in tracker.serving()] == ["a", "b"]
    assert tracker.knows_model("other") and tracker.knows_model("anything")  # thanks to "c"
    tracker.set_models("c", [{"id": "m2", "object": "model"}])
    assert not tracker.knows_model("anything")
    assert sorted(card["id"] for card in tracker.model_cards()) == ["m", "m2", "other"]
    tracker.update_scraped("c", {"num_requests_waiting": 4.0})
    assert tracker.view(tracker.engines["c"]).num_requests_waiting == 4
    assert 'kvroute_engine_healthy{engine="a"} 1.0' in metrics.render().decode()


def _fields(views: list) -> list[tuple]:
    """What a view says of its engine's state (its load and trust are the core's to write)."""
    return [
        (
            v.engine_id,
            v.url,
            v.healthy,
            v.drained,
            v.models,
            v.num_requests_running,
            v.num_requests_waiting,
            v.kv_cache_usage,
            v.block_size,
            v.extra,
        )
        for v in views
    ]


def test_fleet_views_are_rebuilt_after_every_change_of_what_a_view_reads() -> None:
    # Catches: fleet_views handing out views of a fleet that has changed since (a write from
    # outside load.py, a scrape, a breaker's open time running out without any write).
    import time

    from router.load import LoadTracker

    tracker = LoadTracker(
        [EngineConfig(id="a", url="http://a:1", model="m"), EngineConfig(id="b", url="http://b:1")]
    )
    tracker.configure_breaker(1, 0.05)
    views = tracker.fleet_views()
    assert tracker.fleet_views() is views  # nothing changed: the same views
    tracker.set_health("a", True)  # the value it has: not a change
    assert tracker.fleet_views() is views

    def same_as_fresh() -> list:
        got = tracker.fleet_views()
        assert _fields(got) == _fields(tracker.all_views(with_load=False))
        return got

    changes = [
        lambda: setattr(tracker.engines["b"], "drained", True),  # as POST /admin/.../drain does
        lambda: setattr(tracker.engines["b"], "drained", False),  # as .../undrain (service.py) does
        lambda: tracker.set_health("a", False, "refused"),
        lambda: tracker.set_health("a", True),
        lambda: tracker.update_scraped("b", {"num_requests_waiting": 3.0, "kv_cache_usage_perc": 0.5}),
        lambda: setattr(tracker.engines["b"], "extra", {"cpu_tokens": 1.0}),  # as the scraper does
        lambda: setattr(tracker.engines["b"], "reported_block_size", 32),
        lambda: tracker.set_models("a", [{"id": "m2"}]),
    ]
    for change in changes:
        before = same_as_fresh()
        change()
        after = same_as_fresh()
        assert after is not before and _fields(after) != _fields(before)
    tracker.record_failure("a", "refused")  # one failure opens it (threshold 1) for 0.05 s
    opened = same_as_fresh()
    assert [v.healthy for v in opened] == [False, True]
    deadline = tracker.engines["a"].breaker_open_until_s
    while time.monotonic() <= deadline:  # the open time runs out: no write says so
        pass
    half_open = same_as_fresh()
    assert [v.healthy for v in half_open] == [True, True]
    tracker.claim_trial("a")  # the one trial is out: the others keep away
    assert [v.healthy for v in same_as_fresh()] == [False, True]


def test_the_prompt_names_go_on_from_the_session_keys_hashes_without_encoding_the_start_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chat keyed by how it starts hands the start's message-prefix hashes to the prompt names:
    each message is encoded once per request (a 16K-token first message was encoded twice), and the
    names are those computed from scratch. A key from a header or ``user`` hands none over."""
    import router.tokenize as tokenize

    messages = [
        {"role": "system", "content": "s" * 10_000},
        {"role": "user", "content": "q" * 10_000},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "q2"},
    ]
    from_scratch = tokenize.PromptNames.of(messages)
    encoded: list[object] = []
    real = tokenize._encode_msg
    monkeypatch.setattr(tokenize, "_encode_msg", lambda msg: encoded.append(msg) or real(msg))
    ctx = parse(CHAT, {"model": "m", "messages": messages})
    assert list(ctx.start_prefixes) == from_scratch.prefixes[:2]  # up to the first user message
    assert ctx.route_request.session_key == f"h{from_scratch.prefixes[1]:016x}"
    names = tokenize.PromptNames.of(ctx.body["messages"], ctx.start_prefixes)
    assert names == from_scratch
    assert len(encoded) == len(messages)  # each message once: two by the key, two by the names
    # A later turn keeps the key; a header key hands no hashes over (the names compute them all).
    later = parse(CHAT, {"model": "m", "messages": [*messages, {"role": "assistant", "content": "b"}]})
    assert later.route_request.session_key == ctx.route_request.session_key
    assert parse(CHAT, {"model": "m", "messages": messages}, {"x-session-id": "s1"}).start_prefixes == ()
    # With tools the key also names them; the hashes handed over are still the messages' own.
    tooled = parse(CHAT, {"model": "m", "messages": messages, "tools": [{"type": "function"}]})
    assert tooled.route_request.session_key != ctx.route_request.session_key
    assert list(tooled.start_prefixes) == from_scratch.prefixes[:2]
