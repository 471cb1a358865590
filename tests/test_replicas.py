"""Router replicas sharing state through a real redis-server, in front of a real simulated fleet,
driven through a round-robin front (each request to the next live replica, a refused connection
retried on the following one, as nginx does in compose.yaml):

- every turn of a conversation goes where one replica would send it (approx_prefix, which learns
  only from routing decisions, and tier_cost), with the engine reporting the history as cached;
- a replica restart and a Redis restart cost the clients nothing: no error, and the next turns of
  every conversation still hit their history.
Negative controls run the same traffic with sharing off, to show each check can fail. That each
replica sees the others' in-flight load is checked at the state level in test_replicas_state.py; an
end-to-end burst test was removed: its engine counts (shared [8, 4] / [6, 6] / [4, 4, 4] vs unshared
[12] / [10, 2] / [6, 6]) overlap run to run on correct code, so it failed by chance.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import pytest

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
def replicas(fleet: list[FleetEngine], redis_server: RedisServer) -> Iterator[Callable[..., Replicas]]:
    started: list[Replicas] = []

    def start(count: int, policy: str, *, shared: bool = True, **params: Any) -> Replicas:
        cluster = uuid.uuid4().hex[:8]  # each group of replicas shares only with itself

        def make_app() -> Any:
            data: dict[str, Any] = {
                "engines": [e.fleet_entry() for e in fleet],
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
            return build_router_app(load_config(environ={}, overrides=data))

        group = Replicas(make_app, count)
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


def test_without_sharing_approx_prefix_replicas_split_conversations(
    fleet: list[FleetEngine], replicas: Callable[..., Replicas]
) -> None:
    """The control: approx_prefix learns only from its own replica's decisions, so without the
    shared routing records the other replica does not know where a conversation lives."""
    _reset_fleet(fleet)
    two = Front(replicas(2, "approx_prefix", shared=False).urls)
    chats = [Chat(seed) for seed in range(20, 25)]
    _converse(two, chats, turns=3)
    assert _moved_turns(chats) > 0, [c.engines for c in chats]


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
