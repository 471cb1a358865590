"""The fully wired router (``router.service.build_router_app``) in front of a real 3-engine simulated
fleet, driven with the official openai SDK: conversations stay on the engine holding their history,
/v1/route/explain agrees with what the engine then reports as cached, experiments and forced arms,
admin reload, calibrated costs, and /ready reporting an engine whose KV events never arrive.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvcore import sim_tokenizer as tokenizer
from router.config import load_config
from router.service import build_router_app
from sim.fleet import PROFILES, Fleet, FleetEngine
from sim.server import free_port
from tests.conftest import ThreadedServer

pytestmark = pytest.mark.slow  # a 3-engine fleet

BLOCK_TOKENS = 16
ARMS = [
    {"name": "kv", "policy": "kv_gpu"},
    {"name": "tc", "policy": "tier_cost"},
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[FleetEngine]]:
    profile = replace(PROFILES["tiny"], gpu_blocks=512, cpu_blocks=512, storage_blocks=4096, time_scale=100.0)
    with Fleet(tmp_path_factory.mktemp("live-fleet")) as f:
        yield f.start(3, profile, storage_pool="pool0")


def _router_data(engines: list[FleetEngine], **sections: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "engines": [e.fleet_entry() for e in engines],
        "tokenizer": {"backend": "sim"},
        "experiment": {"name": "live", "arms": ARMS},
        "health": {"interval_s": 0.5},
        "costs": {"scrape_interval_s": 0.2},
        "events": {"silent_after_s": 5.0},
        "log_level": "warning",
    }
    data.update(sections)
    return data


@pytest.fixture
def router_url(fleet: list[FleetEngine], serve_asgi: Callable[..., ThreadedServer]) -> Callable[..., str]:
    def start(**sections: Any) -> str:
        config = load_config(environ={}, overrides=_router_data(fleet, **sections))
        return serve_asgi(build_router_app(config)).url

    return start


def _client(url: str, arm: str | None = None, session: str = "") -> openai.OpenAI:
    headers = {}
    if arm:
        headers["x-kvroute-arm"] = arm
    if session:
        headers["x-session-id"] = session
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, default_headers=headers)


def _settle(url: str, quiet_s: float = 0.3) -> None:
    """Wait until no KV-event batch arrived for ``quiet_s`` (the engines are idle)."""

    def batches() -> Any:
        events = httpx.get(f"{url}/debug/index").json()["events"]["sources"]
        return sorted((name, s["batches"]) for name, s in events.items())

    deadline = time.monotonic() + 30.0
    last, quiet_since = batches(), time.monotonic()
    while time.monotonic() - quiet_since < quiet_s:
        assert time.monotonic() < deadline, "KV events did not settle within 30 s"
        time.sleep(0.05)
        now = batches()
        if now != last:
            last, quiet_since = now, time.monotonic()


class Chat:
    """A conversation resent in full each turn through the router (non-streaming)."""

    def __init__(self, url: str, arm: str, seed: int) -> None:
        self.url = url
        self.arm = arm
        self.session = f"live-{arm}-{seed}"
        self.client = _client(url, arm, self.session)
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": tokenizer.filler_text(48, seed=seed)},
            {"role": "user", "content": f"[{seed}] " + tokenizer.filler_text(150, seed=seed + 1)},
        ]

    def explain(self) -> dict[str, Any]:
        resp = httpx.post(
            f"{self.url}/v1/route/explain",
            json={"model": tokenizer.NAME, "messages": self.messages, "max_tokens": 4},
            headers={"x-kvroute-arm": self.arm, "x-session-id": self.session},
        )
        assert resp.status_code == 200, resp.text
        return resp.json()

    def turn(self, turn_no: int) -> tuple[str, int, int]:
        """(engine, prompt tokens, cached tokens) of the next turn."""
        raw = self.client.chat.completions.with_raw_response.create(
            model=tokenizer.NAME,
            messages=self.messages,  # type: ignore[arg-type]
            max_tokens=4,
        )
        assert raw.headers["x-kvroute-arm"] == self.arm
        reply = raw.parse()
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        self.messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        self.messages.append({"role": "user", "content": tokenizer.filler_text(40, seed=turn_no + 100)})
        return (
            raw.headers["x-kvroute-engine"],
            reply.usage.prompt_tokens,
            reply.usage.prompt_tokens_details.cached_tokens or 0,
        )


@pytest.mark.parametrize("arm", ["kv", "tc"])
def test_conversation_sticks_to_its_history_and_explain_predicts_the_hit(
    arm: str, router_url: Callable[..., str]
) -> None:
    url = router_url()
    chat = Chat(url, arm, seed=11 if arm == "kv" else 23)
    first_engine, _, _ = chat.turn(0)
    cached_seen = [0]
    for turn_no in range(1, 4):
        _settle(url)
        explained = chat.explain()
        assert explained["arm"] == arm and explained["policy"] == ("kv_gpu" if arm == "kv" else "tier_cost")
        chosen = next(e for e in explained["engines"] if e["chosen"])
        engine, prompt_tokens, cached = chat.turn(turn_no)
        assert engine == first_engine == explained["choice"] == chosen["engine_id"]
        # The engine computes at least the last prompt token: hits stop one block short of a
        # prompt that is an exact multiple of the block size.
        hit_blocks = min(chosen["prefix_blocks"], (prompt_tokens - 1) // BLOCK_TOKENS)
        assert cached == hit_blocks * BLOCK_TOKENS, (turn_no, explained, cached)
        assert chosen["prefix_blocks_by_tier"]["gpu"] == chosen["prefix_blocks"]
        others = [e["prefix_blocks"] for e in explained["engines"] if not e["chosen"]]
        assert all(b < chosen["prefix_blocks"] for b in others)
        assert cached > cached_seen[-1]
        cached_seen.append(cached)


def test_experiments_forced_arm_and_unknown_arm(router_url: Callable[..., str]) -> None:
    url = router_url()
    for arm in ("kv", "tc", "kv"):
        raw = _client(url, arm, f"exp-{arm}").chat.completions.with_raw_response.create(
            model=tokenizer.NAME, messages=[{"role": "user", "content": f"hello {arm}"}], max_tokens=2
        )
        assert raw.headers["x-kvroute-arm"] == arm
    with pytest.raises(openai.BadRequestError) as info:
        _client(url, "nope").chat.completions.create(
            model=tokenizer.NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert "kv" in str(info.value) and "tc" in str(info.value) and "nope" in str(info.value)
    report = httpx.get(f"{url}/v1/experiments").json()
    arms = {a["name"]: a for a in report["arms"]}
    assert report["control"] == "kv"
    assert (arms["kv"]["requests"], arms["tc"]["requests"]) == (2, 1)
    assert arms["tc"]["vs_control"]["control"] == "kv"


def test_admin_reload_needs_the_token_and_keeps_session_arms(
    fleet: list[FleetEngine], tmp_path: Path, serve_asgi: Callable[..., ThreadedServer]
) -> None:
    config_path = tmp_path / "router.toml"

    def write(weights: tuple[float, float]) -> None:
        lines = ['log_level = "warning"', "[tokenizer]", 'backend = "sim"', "[admin]", 'token = "s3cret"']
        lines += ["[experiment]", 'name = "reload"']
        for arm, weight in zip(ARMS, weights, strict=True):
            lines += ["[[experiment.arms]]", f'name = "{arm["name"]}"', f'policy = "{arm["policy"]}"']
            lines += [f"weight = {weight}"]
        for e in fleet:
            lines += ["[[engines]]", *(f"{k} = {v!r}".replace("'", '"') for k, v in e.fleet_entry().items())]
        config_path.write_text("\n".join(lines) + "\n")

    write((1.0, 0.0))  # everything on "kv"
    url = serve_asgi(build_router_app(load_config(config_path, environ={}), config_path)).url
    client = _client(url, session="sticky-session")
    raw = client.chat.completions.with_raw_response.create(
        model=tokenizer.NAME, messages=[{"role": "user", "content": "first"}], max_tokens=2
    )
    assert raw.headers["x-kvroute-arm"] == "kv"
    write((0.0, 1.0))  # new sessions now all go to "tc"
    assert httpx.post(f"{url}/admin/reload").status_code == 401
    wrong = httpx.post(f"{url}/admin/reload", headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "invalid_admin_token"
    ok = httpx.post(f"{url}/admin/reload", headers={"authorization": "Bearer s3cret"})
    assert ok.status_code == 200, ok.text
    weights = {a["name"]: a["weight"] for a in httpx.get(f"{url}/v1/experiments").json()["arms"]}
    assert weights == {"kv": 0.0, "tc": 1.0}
    again = client.chat.completions.with_raw_response.create(
        model=tokenizer.NAME, messages=[{"role": "user", "content": "first"}], max_tokens=2
    )
    assert again.headers["x-kvroute-arm"] == "kv"  # the session keeps its arm
    fresh = _client(url, session="new-session").chat.completions.with_raw_response.create(
        model=tokenizer.NAME, messages=[{"role": "user", "content": "other"}], max_tokens=2
    )
    assert fresh.headers["x-kvroute-arm"] == "tc"


def test_admin_disabled_without_token(router_url: Callable[..., str]) -> None:
    url = router_url()
    resp = httpx.post(f"{url}/admin/reload", headers={"authorization": "Bearer x"})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "admin_disabled"


def test_non_stream_traffic_leaves_costs_alone_and_metrics_expose_them(
    router_url: Callable[..., str],
) -> None:
    url = router_url()
    chat = Chat(url, "tc", seed=41)
    for turn_no in range(4):
        chat.turn(turn_no)
    costs = httpx.get(f"{url}/debug/costs").json()
    # The default storage_spread (inf, off) goes out as null: JSON has no infinity (was a 500).
    assert costs["calibration"]["storage_spread"] is None
    # A non-stream answer has no first token: nothing to calibrate with, estimates stay at the prior.
    assert costs["core"]["finished"] == 4 and costs["core"]["calibrations"] == 0
    for entry in costs["engines"].values():
        assert entry["observations"] == 0 and entry["estimate"] == entry["prior"]
    text = httpx.get(f"{url}/metrics").text
    assert "kvroute_cost_prefill_tokens_per_second{" in text
    assert 'kvroute_kv_event_batches_total{engine="e0"}' in text
    assert 'kvroute_index_blocks{engine="' in text
    assert 'arm="tc"' in text
    # Turns 2-4 took their history's block keys from the conversation cache.
    blocks = {
        source: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        for source in ("reused", "hashed")
        if line.startswith(f'kvroute_prompt_blocks_total{{source="{source}"}}')
    }
    assert blocks["reused"] > 0 and blocks["hashed"] > 0, blocks


def test_ready_reports_an_engine_whose_events_never_arrive(
    fleet: list[FleetEngine], serve_asgi: Callable[..., ThreadedServer]
) -> None:
    engine = replace(fleet[0], kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}", replay_endpoint="")
    data = _router_data(
        [engine],
        experiment={"arms": []},
        policy={"name": "round_robin"},
        events={"silent_after_s": 0.3},
    )
    url = serve_asgi(build_router_app(load_config(environ={}, overrides=data))).url
    before = httpx.get(f"{url}/ready").json()
    assert before["events"]["silent_engines"] == {}  # no traffic yet: nothing to expect
    # A prompt of several blocks: the engine's prefix-cache counters then prove it cached new
    # blocks (a prompt under one block would prove nothing and must not raise the alarm). The
    # proof takes two scrapes around the request: on a loaded machine the router's first scrape
    # can come after the first request, so a new one (new blocks) goes out each second until then.
    sent = 0
    deadline = time.monotonic() + 30.0
    last_sent = -1.0
    while True:
        if time.monotonic() - last_sent >= 1.0:
            _client(url).chat.completions.create(
                model=tokenizer.NAME,
                messages=[{"role": "user", "content": f"anyone listening {sent}? " * 20}],
                max_tokens=2,
            )
            sent += 1
            last_sent = time.monotonic()
        ready = httpx.get(f"{url}/ready").json()
        if engine.id in ready["events"]["silent_engines"]:
            break
        assert time.monotonic() < deadline, ready
        time.sleep(0.1)
    assert ready["events"]["ok"] is False
    reason = ready["events"]["silent_engines"][engine.id]
    assert "kv_events_endpoint" in reason and "prefix-cache counters" in reason
    deadline = time.monotonic() + 30.0
    while f'kvroute_event_source_silent{{engine="{engine.id}"}} 1.0' not in httpx.get(f"{url}/metrics").text:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_engine_block_size_wins_over_a_wrong_config(
    fleet: list[FleetEngine], serve_asgi: Callable[..., ThreadedServer]
) -> None:
    """Configured block_size 32 against engines using 16: the scraped vllm:cache_config_info
    corrects the keys (else every match would silently be zero) and the mismatch is reported."""
    entries = [{**e.fleet_entry(), "block_size": 32} for e in fleet]
    data = _router_data(fleet, experiment={"arms": []}, policy={"name": "kv_gpu"})
    data["engines"] = entries
    url = serve_asgi(build_router_app(load_config(environ={}, overrides=data))).url
    deadline = time.monotonic() + 30.0
    while not httpx.get(f"{url}/debug/costs").json()["block_size_mismatch"]:
        assert time.monotonic() < deadline, "no scrape reported the engines' block size"
        time.sleep(0.05)
    chat = Chat(url, "default", seed=77)
    chat.turn(0)
    _settle(url)
    explained = chat.explain()
    assert explained["block_size"] == 16
    assert max(e["prefix_blocks"] for e in explained["engines"]) > 0
    ready = httpx.get(f"{url}/ready").json()
    assert "block_size 16" in ready["events"]["block_size_mismatch"][fleet[0].id]


def test_stream_without_include_usage_gets_no_usage_chunk_but_the_router_counts_cached_tokens(
    router_url: Callable[..., str],
) -> None:
    url = router_url()
    body = {
        "model": tokenizer.NAME,
        "messages": [{"role": "user", "content": tokenizer.filler_text(80, seed=5)}],
        "max_tokens": 4,
        "stream": True,
    }
    headers = {"x-kvroute-arm": "tc", "x-session-id": "usage-strip"}
    events: list[bytes] = []
    for _ in range(2):  # the second turn hits the first one's blocks
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status_code == 200
            raw = b"".join(resp.iter_bytes())
        events = [e for e in raw.split(b"\n\n") if e.strip()]
        assert events[-1] == b"data: [DONE]"
        assert all(b'"usage"' not in e for e in events), raw  # the client did not ask for usage
    assert any(b'"content"' in e for e in events)
    arm = next(a for a in httpx.get(f"{url}/v1/experiments").json()["arms"] if a["name"] == "tc")
    assert arm["requests_with_usage"] == arm["requests"] >= 2
    assert arm["hit_rate"] is not None and arm["hit_rate"] > 0
    # A client that asks for usage still gets the engine's chunk, unchanged.
    with_usage = {**body, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=with_usage, headers=headers) as resp:
        raw = b"".join(resp.iter_bytes())
    assert b'"choices":[],' in raw.replace(b" ", b"") and b'"cached_tokens"' in raw


def _old_session_key(messages: list[dict[str, Any]]) -> str:
    """The rule before the fix: a hash of the first two messages."""
    import msgspec
    import xxhash

    return "h" + xxhash.xxh3_64_hexdigest(msgspec.json.encode(messages[:2]))


def test_no_arm_flips_over_40_conversations_without_system_prompt_or_session_header(
    router_url: Callable[..., str],
) -> None:
    """vLLM's multi-turn benchmark client at its defaults: no system prompt, no X-Session-ID,
    no ``user``. Turn 1 is [user1], turn 2 [user1, assistant1, user2]: the arm must not change."""
    from router.experiments import Experiments

    url = router_url()
    client = _client(url)
    flips = old_rule_flips = 0
    old_rule = Experiments({"arms": ARMS})
    for conv in range(40):
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": f"conversation {conv}: " + tokenizer.filler_text(30, seed=conv)}
        ]
        arms = []
        for turn in range(2):
            raw = client.chat.completions.with_raw_response.create(
                model=tokenizer.NAME,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=3,
            )
            arms.append(raw.headers["x-kvroute-arm"])
            if turn == 0:
                old_first = old_rule.assign(_old_session_key(messages)).name
            else:
                old_rule_flips += old_rule.assign(_old_session_key(messages)).name != old_first
            reply = raw.parse().choices[0].message.content or ""
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
        flips += arms[0] != arms[1]
    print(f"arm flips over 40 conversations: {flips} (old first-two-messages rule: {old_rule_flips})")
    assert flips == 0
    assert old_rule_flips > 0  # the workload does exercise the old bug


def test_ready_does_not_count_drained_engines(router_url: Callable[..., str]) -> None:
    url = router_url(admin={"token": "t"})
    auth = {"authorization": "Bearer t"}
    assert httpx.get(f"{url}/ready").json()["healthy_engines"] == 3
    for engine_id in ("e0", "e1", "e2"):
        assert httpx.post(f"{url}/admin/engines/{engine_id}/drain", headers=auth).status_code == 200
    ready = httpx.get(f"{url}/ready")
    assert ready.status_code == 503
    assert ready.json()["healthy_engines"] == 0 and ready.json()["engines"]["e0"]["drained"] is True


def _pool_copies(chat: Chat) -> dict[str, dict[str, Any]]:
    """Explain's engines once every candidate holds the conversation's history in the shared pool
    (the engine writes it through after its answer; the STORAGE events follow): waited on, up to
    30 s."""
    deadline = time.monotonic() + 30.0
    while True:
        engines = {e["engine_id"]: e for e in chat.explain()["engines"]}
        if all(e["prefix_blocks_by_tier"]["storage"] > 0 for e in engines.values()):
            return engines
        assert time.monotonic() < deadline, f"the pool copy never reached the index: {engines}"
        time.sleep(0.05)


def test_a_booked_pool_read_is_priced_on_every_engine_of_the_pool(router_url: Callable[..., str]) -> None:
    # The fleet's engines mount one pool; with its bandwidth configured, the router books what
    # each turn moves there (its STORAGE read and the blocks it computes, which the engines write
    # through), and prices a STORAGE read on every engine of the pool with the wait behind it. A turn
    # routed away from its history (drained) reads the history from the pool. 1 byte/s: the queue
    # does not drain within the test (it loses a second per second: the tolerances below).
    url = router_url(
        admin={"token": "t"},
        costs={"scrape_interval_s": 0.2, "storage_pool_bandwidth": {"pool0": 1.0}},
    )
    auth = {"authorization": "Bearer t"}

    def queue_s() -> float:
        return float(httpx.get(f"{url}/debug/costs").json()["storage_read_queue"]["pool0"]["queue_s"])

    chat = Chat(url, "tc", seed=59)
    home, prompt_tokens, _ = chat.turn(0)
    _settle(url)
    first = queue_s()  # the first turn computed its whole prompt: all of it written through
    assert first == pytest.approx(prompt_tokens * 131_072, abs=30.0)
    assert httpx.post(f"{url}/admin/engines/{home}/drain", headers=auth).status_code == 200
    before = _pool_copies(chat)
    assert home not in before
    assert all(e["scores"]["read_wait_s"] == pytest.approx(first, abs=30.0) for e in before.values())
    engine, _, cached = chat.turn(1)  # (the two engines tie: either may take it)
    moved = before[engine]
    assert cached > 0  # it read the history from the pool
    # Its read and the blocks it computes, at the router's prior KV bytes per token.
    booked = (moved["scores"]["hit_tokens_storage"] + moved["scores"]["prefill_tokens"]) * 131_072
    second = queue_s()
    assert second - first == pytest.approx(booked, abs=30.0)
    _settle(url)
    after = chat.explain()
    third = next(e for e in after["engines"] if e["engine_id"] not in (home, engine))
    assert third["prefix_blocks_by_tier"]["storage"] > 0  # it holds the history only in the pool
    assert third["scores"]["read_wait_s"] == pytest.approx(second, abs=30.0)
    assert third["scores"]["total_s"] > second - 30.0
    for e in after["engines"]:  # an engine reading nothing from the pool waits for nothing there
        if e["prefix_blocks_by_tier"]["storage"] == 0:
            assert e["scores"]["read_wait_s"] == 0.0
