"""Router replicas sharing state through a real redis-server, in front of a real simulated fleet,
driven through a round-robin front (each request to the next live replica, a refused connection
retried on the following one, as nginx does in compose.yaml):

- every turn of a conversation goes where one replica would send it (approx_prefix, which learns
  only from routing decisions, and tier_cost), with the engine reporting the history as cached;
- a 12-request burst sharing a prefix that one engine holds is placed by two replicas exactly as one
  replica places it (tier_cost; [7, 4, 1]): the engines are occupied so nothing completes during the
  burst, and each request is sent once the previous one is queued on its engine and known to the
  other replica, so the outcome is one fixed shape, not a distribution;
- a replica restart and a Redis restart cost the clients nothing: no error, and the next turns of
  every conversation still hit their history.
Negative controls run the same traffic with sharing off, to show each check can fail (the burst:
every request lands on the prefix's engine, [12, 0, 0]).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcore import sim_tokenizer
from loadtest.redis_server import RedisServer, redis_binary
from router.config import load_config
from router.service import build_router_app
from sim.fleet import PROFILES, Fleet, FleetEngine
from tests.conftest import ThreadedServer

pytestmark = pytest.mark.skipif(
    redis_binary() is None, reason="redis-server binary not found (apt-get install redis-server)"
)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[FleetEngine]]:
    profile = replace(PROFILES["tiny"], gpu_blocks=1024, cpu_blocks=0, storage_blocks=0, time_scale=2.0)
    with Fleet(tmp_path_factory.mktemp("replica-fleet")) as f:
        yield f.start(3, profile)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as server:
        yield server


@dataclass
class Replicas:
    """N router replicas of one config; ``start``/``stop`` one by index (a restart keeps its port)."""

    make_app: Callable[[], Any]
    count: int
    #: The Redis key space these replicas share (``kvroute:<cluster>:``).
    cluster: str = ""
    servers: list[ThreadedServer | None] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for _ in range(self.count):
            server = ThreadedServer(self.make_app()).start()
            self.servers.append(server)
            self.ports.append(server.port)

    def stop(self, i: int) -> None:
        server = self.servers[i]
        if server is not None:
            server.stop()
            self.servers[i] = None

    def start(self, i: int) -> None:
        assert self.servers[i] is None
        self.servers[i] = ThreadedServer(self.make_app(), port=self.ports[i]).start()

    def close(self) -> None:
        for i in range(self.count):
            self.stop(i)

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]


class Front:
    """Round robin over the replicas; a refused connection goes to the next one (nginx's
    proxy_next_upstream error): the request was not sent, so retrying it is safe."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self._next = itertools.cycle(range(len(urls)))
        self.client = httpx.Client(timeout=30.0)
        self.failovers = 0

    def post(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
        for _ in range(len(self.urls)):
            url = self.urls[next(self._next)]
            try:
                return self.client.post(url + path, json=body, headers=headers)
            except httpx.ConnectError:
                self.failovers += 1
        raise AssertionError("no replica accepted the connection")

    @contextlib.contextmanager
    def open_stream(self, body: dict[str, Any]) -> Iterator[httpx.Response]:
        url = self.urls[next(self._next)]
        with self.client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            yield resp


@pytest.fixture
def replicas(request: pytest.FixtureRequest, redis_server: RedisServer) -> Iterator[Callable[..., Replicas]]:
    """Factory: ``replicas(count, policy, shared=True, engines=fleet, config={}, **policy_params)``;
    the module's ``fleet`` is started only for a test that uses it."""
    started: list[Replicas] = []

    def start(
        count: int,
        policy: str,
        *,
        shared: bool = True,
        engines: list[FleetEngine] | None = None,
        config: dict[str, Any] | None = None,
        **params: Any,
    ) -> Replicas:
        cluster = uuid.uuid4().hex[:8]  # each group of replicas shares only with itself
        targets: list[FleetEngine] = engines if engines is not None else request.getfixturevalue("fleet")

        def make_app() -> Any:
            data: dict[str, Any] = {
                "engines": [e.fleet_entry() for e in targets],
                "tokenizer": {"backend": "sim"},
                "policy": {"name": policy, "params": params},
                "health": {"interval_s": 0.5},
                # Load figures come from the routers' own accounting only (no engine scrapes), so
                # a decision depends on what the replicas tell each other.
                "costs": {"scrape_interval_s": 0},
                "log_level": "warning",
            }
            if shared:
                # A generous timeout: a busy test machine must not flip replicas into local mode.
                data["shared"] = {
                    "redis_url": redis_server.url,
                    "cluster": cluster,
                    "ttl_s": 2.0,
                    "timeout_s": 1.0,
                }
            for key, value in (config or {}).items():  # one level deep: sections merge
                data[key] = {**data[key], **value} if isinstance(data.get(key), dict) else value
            return build_router_app(load_config(environ={}, overrides=data))

        group = Replicas(make_app, count, cluster=cluster)
        started.append(group)
        return group

    yield start
    for group in started:
        group.close()


def _reset_fleet(fleet: list[FleetEngine]) -> None:
    for engine in fleet:
        httpx.post(f"{engine.url}/reset_prefix_cache").raise_for_status()


class Chat:
    """One conversation resent in full each turn (what chat clients do)."""

    def __init__(self, seed: int) -> None:
        self.session = f"conv-{seed}-{uuid.uuid4().hex[:6]}"
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": sim_tokenizer.filler_text(64, seed=seed)},
            {"role": "user", "content": f"[{seed}] " + sim_tokenizer.filler_text(300, seed=seed + 1)},
        ]
        self.engines: list[str] = []
        self.cached: list[int] = []

    def turn(self, front: Front) -> None:
        body = {"model": sim_tokenizer.NAME, "messages": self.messages, "max_tokens": 4}
        resp = front.post("/v1/chat/completions", body, {"x-session-id": self.session})
        assert resp.status_code == 200, resp.text
        doc = resp.json()
        self.engines.append(resp.headers["x-kvroute-engine"])
        self.cached.append(doc["usage"]["prompt_tokens_details"]["cached_tokens"] or 0)
        self.messages.append({"role": "assistant", "content": doc["choices"][0]["message"]["content"]})
        turn_no = len(self.engines)
        self.messages.append({"role": "user", "content": sim_tokenizer.filler_text(60, seed=900 + turn_no)})


def _converse(front: Front, chats: list[Chat], turns: int, pause_s: float = 0.3) -> None:
    # An odd number of chats behind two replicas: each chat's consecutive turns go to different
    # replicas (with an even number every chat would always meet the same replica).
    assert len(chats) % 2 == 1
    for _ in range(turns):
        for chat in chats:
            chat.turn(front)
            # The previous request's finish reaches Redis (written after the answer, as in
            # production where the next turn comes after a think time).
            time.sleep(0.05)
        time.sleep(pause_s)  # the engines' KV events and the routing records arrive


def _moved_turns(chats: list[Chat]) -> int:
    return sum(e != chat.engines[0] for chat in chats for e in chat.engines[1:])


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["approx_prefix", "tier_cost"])
def test_every_turn_goes_where_one_replica_would_send_it(
    policy: str, fleet: list[FleetEngine], replicas: Callable[..., Replicas]
) -> None:
    _reset_fleet(fleet)
    one = Front(replicas(1, policy).urls)
    alone = [Chat(seed) for seed in range(5)]
    _converse(one, alone, turns=4)
    assert _moved_turns(alone) == 0, [c.engines for c in alone]

    _reset_fleet(fleet)
    two = Front(replicas(2, policy).urls)
    chats = [Chat(seed) for seed in range(10, 15)]
    _converse(two, chats, turns=4)
    # Turns alternate between the replicas, and still every conversation stays on its engine
    # and the engine reports its history as cached from the second turn on.
    assert _moved_turns(chats) == 0, [c.engines for c in chats]
    assert all(c > 0 for chat in chats for c in chat.cached[1:]), [c.cached for c in chats]


@pytest.mark.slow
def test_without_sharing_approx_prefix_replicas_split_conversations(
    fleet: list[FleetEngine], replicas: Callable[..., Replicas]
) -> None:
    """The control: approx_prefix learns only from its own replica's decisions, so without the
    shared routing records the other replica does not know where a conversation lives. The other
    replica's first pick for a conversation is a tie broken by request id, the same engine one
    time in three: with five conversations none moved once (a 1-in-243 draw, seen in a CI run);
    with seven, 1 in 2,187."""
    _reset_fleet(fleet)
    two = Front(replicas(2, "approx_prefix", shared=False).urls)
    chats = [Chat(seed) for seed in range(20, 27)]
    _converse(two, chats, turns=4)
    assert _moved_turns(chats) > 0, [c.engines for c in chats]


# -- a burst split across replicas ----------------------------------------------------------------

#: Engines that run one request at a time (vLLM's --max-num-seqs 1). A long request sent straight to
#: each engine (another client's, invisible to the routers) keeps it busy, so every burst request
#: waits in the engine's queue: no prefill ends and no KV event arrives while the burst is routed.
#: Each choice then depends only on the routers' own accounting (in-flight requests, queued prefill
#: tokens, speculative prefix entries) and on what the replicas told each other: one outcome, no race.
BUSY_PROFILE = replace(
    PROFILES["tiny"],
    gpu_blocks=4096,
    cpu_blocks=0,
    storage_blocks=0,
    time_scale=1.0,
    extra_args=("--profile-overrides", json.dumps({"max_num_seqs": 1, "step_overhead_s": 0.02})),
)
BURST_SIZE = 12
#: A shared prefix that one engine holds, then a different suffix per request. With tier_cost's
#: prior of 10,000 prefill tokens/s and 5 ms per request in flight, one router sends the burst's
#: first requests to the prefix's engine until its queued prefill outweighs the hit, then moves to
#: a second engine (which holds the prefix from then on: speculation), then a third: [7, 4, 1]
#: with this prefix (the shape is constant for prefixes of about 544-608 tokens).
BURST_PREFIX_TOKENS = 576
BURST_SUFFIX_TOKENS = 128
BURST_ROUTER_CONFIG: dict[str, Any] = {
    "costs": {"priors": {"prefill_tokens_per_s": 10_000.0}},
    # Nothing may change but what the burst does, however slow the machine: speculative entries
    # outlive the burst, no health poll can time out and drop an engine, and a slow Redis answer
    # does not put a replica into local mode.
    "index": {"speculation_ttl_s": 300.0},
    "health": {"interval_s": 0.0},
    "shared": {"timeout_s": 5.0},
}
BURST_POLICY: dict[str, Any] = {"decode_s_per_running": 0.005}


@pytest.fixture(scope="module")
def busy_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[FleetEngine]]:
    with Fleet(tmp_path_factory.mktemp("busy-fleet")) as f:
        yield f.start(3, BUSY_PROFILE)


def _burst_body(label: str, *, stream: bool = False, max_tokens: int = 1) -> dict[str, Any]:
    prefix = sim_tokenizer.filler_text(BURST_PREFIX_TOKENS, seed=77)
    suffix = sim_tokenizer.filler_text(BURST_SUFFIX_TOKENS, seed=zlib.crc32(label.encode()) % 10_000)
    return {
        "model": sim_tokenizer.NAME,
        "messages": [{"role": "user", "content": f"{prefix} [{label}] {suffix}"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def _until(what: str, check: Callable[[], Awaitable[tuple[bool, Any]]], timeout_s: float = 30.0) -> Any:
    """Poll ``check`` (-> (done, detail)) until done; the detail is returned, or shown on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        done, detail = await check()
        if done:
            return detail
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; last seen: {detail}")
        await asyncio.sleep(0.02)


async def _engine_queues(client: httpx.AsyncClient, engines: list[FleetEngine]) -> dict[str, tuple[int, int]]:
    """(running, waiting) requests per engine, from each engine's own /metrics."""
    out = {}
    for engine in engines:
        text = (await client.get(f"{engine.url}/metrics")).text
        values = {
            sample.name: int(sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
        }
        out[engine.id] = (values["vllm:num_requests_running"], values["vllm:num_requests_waiting"])
    return out


async def _metric_total(client: httpx.AsyncClient, urls: list[str], name: str) -> float:
    total = 0.0
    for url in urls:
        for family in text_string_to_metric_families((await client.get(f"{url}/metrics")).text):
            total += sum(s.value for s in family.samples if s.name == name)
    return total


REMOTE_ROUTED = "kvroute_shared_state_remote_routed_total"


async def _warm_prefix(client: httpx.AsyncClient, holder: FleetEngine, group: Replicas) -> int:
    """The prefix, computed by ``holder``; every replica learns it from that engine's KV events.
    Returns the prefix tokens the replicas match on ``holder``."""
    warm = await client.post(f"{holder.url}/v1/chat/completions", json=_burst_body("warm"))
    assert warm.status_code == 200, warm.text

    async def prefix_seen() -> tuple[bool, Any]:
        seen = []
        for url in group.urls:
            doc = (await client.post(f"{url}/v1/route/explain", json=_burst_body("probe"))).json()
            seen.append({e["engine_id"]: e["prefix_tokens"] for e in doc["engines"]})
        only_holder = all(v == 0 for s in seen for e, v in s.items() if e != holder.id)
        return all(s[holder.id] > 0 for s in seen) and only_holder, seen

    seen = await _until(f"every replica to index the prefix on {holder.id}", prefix_seen)
    return int(seen[0][holder.id])


async def _occupy(
    stack: contextlib.AsyncExitStack, client: httpx.AsyncClient, engines: list[FleetEngine]
) -> None:
    """Another client's long stream on each engine (closed, so aborted, when ``stack`` exits)."""
    for engine in engines:
        body = {
            "model": sim_tokenizer.NAME,
            "messages": [{"role": "user", "content": f"another client {engine.id}"}],
            "max_tokens": 6000,  # two minutes at least: longer than any burst
            "stream": True,
        }
        url = f"{engine.url}/v1/chat/completions"
        resp = await stack.enter_async_context(client.stream("POST", url, json=body))
        assert resp.status_code == 200


@dataclass
class SharedWatch:
    """What the replicas wrote to Redis and delivered to each other (not what they did with it)."""

    client: httpx.AsyncClient
    redis: Any
    group: Replicas
    replica_ids: list[str] = field(default_factory=list)
    remote_before: float = 0.0

    async def start(self) -> None:
        for url in self.group.urls:
            ready = (await self.client.get(f"{url}/ready")).json()
            self.replica_ids.append(ready["shared_state"]["replica_id"])
        self.remote_before = await _metric_total(self.client, self.group.urls, REMOTE_ROUTED)

    async def landed(self, counts: dict[str, int]) -> tuple[bool, Any]:
        """Every replica's in-flight requests per engine are in Redis, and each routing record so
        far has reached every other replica."""
        in_flight = dict.fromkeys(counts, 0)
        for rid in self.replica_ids:
            share = await self.redis.hgetall(f"kvroute:{self.group.cluster}:load:{rid}")
            for key, value in share.items():
                if key.startswith(b"f:"):
                    in_flight[key[2:].decode()] += int(value)
        applied = await _metric_total(self.client, self.group.urls, REMOTE_ROUTED) - self.remote_before
        routed = sum(counts.values())
        return in_flight == counts and applied == (self.group.count - 1) * routed, (in_flight, applied)


async def _burst(engines: list[FleetEngine], group: Replicas, redis_url: str | None) -> dict[str, int]:
    """Warm the prefix on the first engine, occupy every engine, then send the burst through the
    round-robin front one request at a time: each once the engine has it queued and, with shared
    state, once the other replicas can know of it. Returns the burst requests per engine, as the
    engines themselves counted them."""
    counts = dict.fromkeys((e.id for e in engines), 0)
    tasks: list[asyncio.Task[httpx.Response]] = []
    async with httpx.AsyncClient(timeout=60.0) as client, contextlib.AsyncExitStack() as stack:
        prefix_tokens = await _warm_prefix(client, engines[0], group)
        await _occupy(stack, client, engines)
        watch = None
        if redis_url is not None and group.count > 1:
            import redis.asyncio as aioredis

            watch = SharedWatch(client, aioredis.from_url(redis_url), group)
            stack.push_async_callback(watch.redis.aclose)
            await watch.start()

        async def queued() -> tuple[bool, Any]:
            for task in tasks:
                if task.done():  # an answer while the engines are occupied means a failure
                    resp = task.result()
                    raise AssertionError(f"a burst request was answered: {resp.status_code} {resp.text}")
            queues = await _engine_queues(client, engines)
            waiting = sum(w for _, w in queues.values())
            return all(r == 1 for r, _ in queues.values()) and waiting == len(tasks), queues

        try:
            for i in range(BURST_SIZE):
                url = f"{group.urls[i % group.count]}/v1/chat/completions"  # the round-robin front
                tasks.append(asyncio.create_task(client.post(url, json=_burst_body(f"b{i}"))))
                queues = await _until(f"burst request {i} to be queued on an engine", queued)
                (engine_id,) = [e for e, (_, w) in queues.items() if w > counts[e]]
                counts[engine_id] += 1
                # One replica, or no sharing: its own accounting changed before it sent.
                if watch is not None:
                    await _until(
                        f"burst request {i} to reach the other replicas", lambda: watch.landed(counts)
                    )
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async with httpx.AsyncClient(timeout=10.0) as client:  # the occupying streams were aborted

        async def drained() -> tuple[bool, Any]:
            queues = await _engine_queues(client, engines)
            return all(q == (0, 0) for q in queues.values()), queues

        await _until("the engines to drain the burst", drained)
        errors = await _metric_total(client, group.urls, "kvroute_shared_state_errors_total")
    # Shared-state errors would mean a replica routed part of the burst on local knowledge.
    print(
        f"burst over {group.count} replica(s), prefix {prefix_tokens} tokens: {counts}, "
        f"shared-state errors {errors:g}"
    )
    assert errors == 0, f"shared-state errors during the burst: {errors:g} (see the replicas' logs)"
    return counts


def _shape(counts: dict[str, int], holder: str) -> tuple[int, list[int]]:
    """(requests on the engine holding the prefix, the others' counts in decreasing order)."""
    return counts[holder], sorted((c for e, c in counts.items() if e != holder), reverse=True)


async def _burst_with(
    busy_fleet: list[FleetEngine], replicas: Callable[..., Replicas], redis_url: str, count: int, shared: bool
) -> tuple[int, list[int]]:
    _reset_fleet(busy_fleet)
    group = replicas(
        count,
        "tier_cost",
        shared=shared,
        engines=busy_fleet,
        config=BURST_ROUTER_CONFIG,
        **BURST_POLICY,
    )
    try:
        counts = await _burst(busy_fleet, group, redis_url if shared else None)
    finally:
        group.close()
    assert sum(counts.values()) == BURST_SIZE
    return _shape(counts, busy_fleet[0].id)


@pytest.mark.slow
async def test_a_burst_split_across_replicas_spreads_like_one_replicas(
    busy_fleet: list[FleetEngine], redis_server: RedisServer, replicas: Callable[..., Replicas]
) -> None:
    """Two replicas behind a round-robin front, each choosing every other request of a burst,
    place it exactly as one replica does: each sees the other's in-flight requests and queued
    prefill (so the prefix's engine fills up at the same point) and its speculative prefix entries
    (so both follow the burst to the same second engine)."""
    one = await _burst_with(busy_fleet, replicas, redis_server.url, 1, shared=True)
    # The burst does spread: otherwise "like one replica" would prove nothing about shared load.
    assert one[0] < BURST_SIZE and one[1][0] > 0, one
    two = await _burst_with(busy_fleet, replicas, redis_server.url, 2, shared=True)
    assert two == one


@pytest.mark.slow
async def test_without_sharing_a_burst_split_across_replicas_herds(
    busy_fleet: list[FleetEngine], redis_server: RedisServer, replicas: Callable[..., Replicas]
) -> None:
    """The control: replicas that do not share each see half the prefix engine's queue, so that
    engine takes more of the burst than one replica would give it (the herd the sharing prevents)."""
    one = await _burst_with(busy_fleet, replicas, redis_server.url, 1, shared=False)
    two = await _burst_with(busy_fleet, replicas, redis_server.url, 2, shared=False)
    assert two[0] > one[0], (one, two)


@pytest.mark.slow
def test_replica_and_redis_restarts_cost_the_clients_nothing(
    fleet: list[FleetEngine], redis_server: RedisServer, replicas: Callable[..., Replicas]
) -> None:
    _reset_fleet(fleet)
    group = replicas(2, "approx_prefix")
    front = Front(group.urls)
    chats = [Chat(seed) for seed in range(40, 45)]
    _converse(front, chats, turns=2)

    group.stop(1)  # replica 1 goes away; the front fails over to replica 0
    _converse(front, chats, turns=1)
    assert front.failovers > 0
    group.start(1)  # comes back empty and relearns the others' routing records from Redis
    time.sleep(0.5)
    _converse(front, chats, turns=2)

    redis_server.restart()  # the routing records in Redis are gone; replicas keep their tables
    _converse(front, chats, turns=2)
    assert _moved_turns(chats) == 0, [c.engines for c in chats]
    assert all(c > 0 for chat in chats for c in chat.cached[1:]), [c.cached for c in chats]
    deadline = time.monotonic() + 5.0
    while True:
        ready = [httpx.get(f"{url}/ready").json() for url in group.urls]
        if all(r["shared_state"]["ok"] for r in ready) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert all(r["shared_state"]["ok"] for r in ready), [r["shared_state"] for r in ready]
