"""The live index against a real 2-engine simulated fleet: an EventManager subscribed to both
engines' ZMQ publishers feeds a PrefixIndex, and before every turn of a multi-turn chat the index's
prediction (blocks per tier) must equal what the serving engine then reports as cached. Then one
engine is killed and restarted on the same ports: its GPU/CPU entries must go, the shared pool stays.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvcore import sim_tokenizer as tokenizer
from kvcore.index import PrefixIndex
from kvcore.keys import block_keys
from policies.base import PrefixMatch, Tier
from router.events import EventManager, EventSource
from sim.fleet import PROFILES, Fleet, FleetEngine

pytestmark = pytest.mark.slow  # engine processes

BLOCK_TOKENS = 16
POOL = "pool0"
TIER_NAMES = ("GPU", "CPU", "STORAGE")


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Fleet, list[FleetEngine]]]:
    profile = replace(PROFILES["tiny"], gpu_blocks=64, cpu_blocks=128, storage_blocks=1024, time_scale=100.0)
    with Fleet(tmp_path / "fleet") as f:
        yield f, f.start(2, profile, storage_pool=POOL)


@pytest.fixture
async def live_index(
    fleet: tuple[Fleet, list[FleetEngine]],
) -> AsyncIterator[tuple[PrefixIndex, EventManager]]:
    _, engines = fleet
    index = PrefixIndex(
        storage_pools={POOL: 1024}, engine_storage_pool={e.id: e.storage_pool for e in engines}
    )
    sources = [
        EventSource(e.id, e.kv_events_endpoint, e.replay_endpoint, topic=e.kv_events_topic) for e in engines
    ]
    manager = EventManager(index, sources, backoff_initial_s=0.05, backoff_max_s=0.2)
    await manager.start()
    try:
        yield index, manager
    finally:
        await manager.stop()


def _by_source(metrics_text: str, engine_id: str) -> tuple[int, int, int]:
    """The engine's vllm:prompt_tokens_cached_by_source_total per tier (GPU, CPU, STORAGE)."""
    values = dict.fromkeys(TIER_NAMES, 0)
    for line in metrics_text.splitlines():
        if line.startswith("vllm:prompt_tokens_cached_by_source_total{") and f'engine="{engine_id}"' in line:
            for tier in TIER_NAMES:
                if f'source="{tier}"' in line:
                    values[tier] += int(float(line.rsplit(" ", 1)[1]))
    return values["GPU"], values["CPU"], values["STORAGE"]


async def _settle(index: PrefixIndex, manager: EventManager, quiet_s: float = 0.3) -> None:
    """Wait until no batch arrived and the index did not change for ``quiet_s`` (engines idle)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10.0

    def snapshot() -> Any:
        return ([h.batches for h in manager.source_health().values()], index.stats())

    last = snapshot()
    quiet_since = loop.time()
    while loop.time() - quiet_since < quiet_s:
        assert loop.time() < deadline, "KV events did not settle within 10 s"
        await asyncio.sleep(0.05)
        now = snapshot()
        if now != last:
            last, quiet_since = now, loop.time()


def _hit_keys(messages: list[dict[str, Any]]) -> list[int]:
    """Keys of the blocks an engine can hit: full blocks, stopping one block short of a full
    prompt (vLLM always computes the last token)."""
    prompt = tokenizer.encode_chat(messages)
    hit_blocks = (len(prompt) - 1) // BLOCK_TOKENS
    return block_keys(prompt[: hit_blocks * BLOCK_TOKENS], BLOCK_TOKENS)


class Conversation:
    """A chat resent in full every turn; each turn checks the index against the engine's report."""

    def __init__(self, engines: list[FleetEngine], index: PrefixIndex, manager: EventManager) -> None:
        self.engines = {e.id: e for e in engines}
        self.index = index
        self.manager = manager
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": tokenizer.filler_text(40, seed=7)},
            {"role": "user", "content": tokenizer.filler_text(200, seed=1)},
        ]
        self.reports: list[tuple[str, PrefixMatch]] = []

    async def turn(self, engine_id: str, http: httpx.AsyncClient) -> PrefixMatch:
        """Send the next turn to ``engine_id``; assert the index predicted its cache hit exactly."""
        engine = self.engines[engine_id]
        await _settle(self.index, self.manager)
        keys = _hit_keys(self.messages)
        predicted = self.index.match(keys, [engine_id])[engine_id]
        before = _by_source((await http.get(f"{engine.url}/metrics")).text, engine_id)
        async with openai.AsyncOpenAI(base_url=f"{engine.url}/v1", api_key="x", max_retries=0) as client:
            reply = await client.chat.completions.create(
                model=tokenizer.NAME,
                messages=self.messages,  # type: ignore[arg-type]
                max_tokens=4,
            )
        after = _by_source((await http.get(f"{engine.url}/metrics")).text, engine_id)
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        cached_tokens = reply.usage.prompt_tokens_details.cached_tokens or 0
        by_tier_blocks = tuple((a - b) // BLOCK_TOKENS for a, b in zip(after, before, strict=True))
        reported = PrefixMatch(cached_tokens // BLOCK_TOKENS, by_tier_blocks)  # type: ignore[arg-type]
        turn_no = len(self.reports) + 1
        assert predicted == reported, f"turn {turn_no} on {engine_id}: index {predicted}, engine {reported}"
        self.reports.append((engine_id, reported))
        self.messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        self.messages.append({"role": "user", "content": tokenizer.filler_text(40, seed=turn_no + 10)})
        return reported


def _restart_on_same_ports(engine: FleetEngine, deadline_s: float = 20.0) -> subprocess.Popen[bytes]:
    """SIGKILL the engine's process group and start the same command line again (same HTTP, event
    and replay ports); the caller must stop the returned process."""
    cmdline = Path(f"/proc/{engine.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH", "")]))
    os.killpg(engine.pid, signal.SIGKILL)
    assert engine.process is not None
    engine.process.wait(timeout=10)
    deadline = time.monotonic() + deadline_s
    while True:
        log_path = engine.log_path + ".restart"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                cmdline, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            while proc.poll() is None:
                try:
                    if httpx.get(f"{engine.url}/health", timeout=1.0).status_code == 200:
                        return proc
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"restarted {engine.id} not healthy; see {log_path}"
                time.sleep(0.05)
        except BaseException:
            _kill(proc)
            raise
        # It exited (port still in TIME_WAIT or the like): try again until the deadline.
        assert time.monotonic() < deadline, f"restarted {engine.id} kept exiting; see {log_path}"
        time.sleep(0.2)


async def _wait_for_restart_detection(
    manager: EventManager, engine: FleetEngine, restarts_before: int
) -> None:
    """Make the restarted engine publish (an unrelated request) until the manager saw its seq go
    back; retried because the SUB may reconnect only after the first batch went out."""
    loop = asyncio.get_running_loop()
    async with openai.AsyncOpenAI(base_url=f"{engine.url}/v1", api_key="x", max_retries=0) as client:
        for attempt in range(10):
            await client.completions.create(
                model=tokenizer.NAME, prompt=tokenizer.filler_text(40, seed=500 + attempt), max_tokens=1
            )
            deadline = loop.time() + 1.0
            while loop.time() < deadline:
                if manager.source_health()[f"{engine.id}/dp0"].restarts > restarts_before:
                    return
                await asyncio.sleep(0.05)
    raise AssertionError(f"the event manager never noticed that {engine.id} restarted")


def _kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


async def test_index_agrees_with_engines_over_a_multi_turn_chat_and_restart(
    fleet: tuple[Fleet, list[FleetEngine]], live_index: tuple[PrefixIndex, EventManager]
) -> None:
    _, (e0, e1) = fleet
    index, manager = live_index
    chat = Conversation([e0, e1], index, manager)
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as http:
        first = await chat.turn("e0", http)  # cold
        second = await chat.turn("e1", http)  # e0's prefix through the shared STORAGE pool
        third = await chat.turn("e0", http)  # e0's own GPU prefix, e1's turn from STORAGE
        # An unrelated long prompt on e0 pushes the chat out of its 64-block GPU pool into CPU.
        async with openai.AsyncOpenAI(base_url=f"{e0.url}/v1", api_key="x", max_retries=0) as client:
            await client.completions.create(
                model=tokenizer.NAME, prompt=tokenizer.filler_text(900, seed=99), max_tokens=1
            )
        fourth = await chat.turn("e0", http)
        fifth = await chat.turn("e1", http)
        # The turns above exercised every tier, so the equalities were not trivially zero.
        assert first == PrefixMatch() and second.blocks_by_tier[Tier.STORAGE] > 0
        assert third.blocks_by_tier[Tier.GPU] > 0 and fourth.blocks_by_tier[Tier.CPU] > 0
        assert fifth.blocks > 0
        await _settle(index, manager)
        e1_before = index.stats()["engines"]["e1"]
        assert e1_before["gpu_blocks"] > 0 and e1_before["cpu_blocks"] > 0

        # Restart e1 on the same ports: its publisher's seq starts at 0 again.
        restarts_before = manager.source_health()["e1/dp0"].restarts
        proc = await asyncio.to_thread(_restart_on_same_ports, e1)
        try:
            await _wait_for_restart_detection(manager, e1, restarts_before)
            await _settle(index, manager)
            # e1's GPU/CPU picture of the chat is gone; the shared pool's copy is still there.
            held = index.match(_hit_keys(chat.messages), ["e1"])["e1"]
            assert held.blocks_by_tier[Tier.GPU] == 0 and held.blocks_by_tier[Tier.CPU] == 0
            assert held.blocks_by_tier[Tier.STORAGE] > 0
            # ... and the restarted engine agrees: the turn's exact check passes on the new e1.
            sixth = await chat.turn("e1", http)
            assert sixth == held
            assert index.stats()["engines"]["e0"]["gpu_blocks"] > 0  # e0 untouched
        finally:
            await asyncio.to_thread(_kill, proc)
