"""A fleet of real engine processes on loopback: start, fleet file, a multi-turn conversation across
two engines that hits GPU, CPU and the shared STORAGE pool, and a stop that leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvcore import sim_tokenizer as tokenizer
from router.config import load_fleet_file
from sim.fleet import PROFILES, Fleet, FleetEngine


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes once its parent reaped it.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, list[FleetEngine]]]:
    profile = replace(PROFILES["tiny"], gpu_blocks=64, cpu_blocks=128, storage_blocks=1024, time_scale=100.0)
    with Fleet(tmp_path_factory.mktemp("fleet")) as f:
        engines = f.start(2, profile)
        yield f, engines


@pytest.mark.slow
def test_fleet_file_is_readable_by_the_router(fleet: tuple[Fleet, list[FleetEngine]]) -> None:
    f, engines = fleet
    path = f.write_fleet_file()
    loaded = load_fleet_file(path)
    assert [e.id for e in loaded] == ["e0", "e1"]
    for cfg, eng in zip(loaded, engines, strict=True):
        assert cfg.url == eng.url and cfg.kv_events_endpoint == eng.kv_events_endpoint
        assert cfg.kv_replay_endpoint == eng.replay_endpoint and cfg.storage_pool == "pool0"
        sources = httpx.get(f"{eng.url}/kv_event_sources").json()
        assert sources["0"]["endpoint"] == eng.kv_events_endpoint
        assert sources["0"]["replay_endpoint"] == eng.replay_endpoint
    ports = {e.kv_events_endpoint for e in engines} | {e.replay_endpoint for e in engines}
    assert len(ports) == 4


@pytest.mark.slow
def test_multi_turn_conversation_hits_every_tier(fleet: tuple[Fleet, list[FleetEngine]]) -> None:
    _, (e0, e1) = fleet
    clients = {e.id: openai.OpenAI(base_url=f"{e.url}/v1", api_key="x", max_retries=0) for e in (e0, e1)}
    messages: list[dict[str, Any]] = [{"role": "user", "content": tokenizer.filler_text(200, seed=1)}]
    cached: list[int] = []

    def turn(engine: FleetEngine, max_tokens: int = 4) -> None:
        r = clients[engine.id].chat.completions.create(
            model=tokenizer.NAME,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
        )
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        cached.append(r.usage.prompt_tokens_details.cached_tokens or 0)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        messages.append({"role": "user", "content": tokenizer.filler_text(30, seed=len(messages))})

    try:
        turn(e0)  # cold: e0 computes and writes through to CPU and the shared pool
        turn(e1)  # e1 never saw it: the shared STORAGE pool serves the prefix
        turn(e0)  # e0 still has it on GPU
        # An unrelated long prompt on e0 pushes the conversation out of its 64-block GPU pool,
        # so the next turn on e0 reloads it from the CPU tier.
        clients["e0"].completions.create(model=tokenizer.NAME, prompt=tokenizer.filler_text(900, seed=99),
                                         max_tokens=1)  # fmt: skip
        turn(e0)
    finally:
        for c in clients.values():
            c.close()
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
    m0 = httpx.get(f"{e0.url}/metrics").text
    m1 = httpx.get(f"{e1.url}/metrics").text
    by_source = "vllm:prompt_tokens_cached_by_source_total"
    assert _metric(m1, by_source, source="STORAGE", engine="e1") > 0
    assert _metric(m1, "vllm:kv_offload_load_bytes_total", medium="STORAGE") > 0
    assert _metric(m0, by_source, source="GPU", engine="e0") > 0
    assert _metric(m0, by_source, source="CPU", engine="e0") > 0
    assert _metric(m0, "vllm:kv_offload_load_bytes_total", medium="CPU") > 0
    assert _metric(m0, "vllm:kv_offload_load_time_total", medium="CPU") > 0


@pytest.mark.slow
def test_stop_leaves_no_process_behind(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    try:
        engines = fleet.start(2, replace(PROFILES["gpu-only"], gpu_blocks=64))
        pids = [e.pid for e in engines]
        assert all(_alive(p) for p in pids)
    finally:
        fleet.stop()
    assert not any(_alive(p) for p in pids)
    assert fleet.engines == []


@pytest.mark.slow
def test_fleet_cli_stops_engines_on_sigterm(tmp_path: Path) -> None:
    fleet_file = tmp_path / "fleet.json"
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sim.fleet", "-n", "2", "--profile", "gpu-only", "--gpu-blocks", "64",
         "--fleet-file", str(fleet_file), "--workdir", str(tmp_path / "work")],
        cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not fleet_file.exists():
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "fleet file not written within 60 s"
            time.sleep(0.1)
        engines = load_fleet_file(fleet_file)
        assert len(engines) == 2
        for e in engines:
            assert httpx.get(f"{e.url}/health").status_code == 200
        pids = [int(line.split()[1]) for line in _engine_ps(proc.pid)]
        assert len(pids) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, "engine processes outlived the fleet"
        time.sleep(0.05)


def _engine_ps(parent_pid: int) -> list[str]:
    """Lines 'ppid pid' of the fleet's direct children (the engine processes)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == parent_pid and fields[0] != "Z":
            out.append(f"{parent_pid} {entry}")
    return out


@pytest.mark.slow
def test_an_event_port_taken_before_the_engine_binds_it_is_retried_with_new_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fleet picks free ports before the engine binds them; another process on the machine can
    take one in between (seen as a flaky "Address already in use" when suites run side by side).
    The fleet must start the engine again on new ports instead of failing."""
    import socket

    import sim.fleet as fleet_module

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real = fleet_module._event_ports
    calls: list[int] = []

    def ports(host: str) -> tuple[int, int]:
        calls.append(1)
        pub, replay = real(host)
        return (taken, replay) if len(calls) == 1 else (pub, replay)

    monkeypatch.setattr(fleet_module, "_event_ports", ports)
    try:
        with Fleet(tmp_path) as f:
            (engine,) = f.start(1, replace(PROFILES["tiny"], time_scale=100.0))
            assert len(calls) == 2  # the first ports were refused by the bind, then new ones
            assert not engine.kv_events_endpoint.endswith(f":{taken}")
            assert httpx.get(f"{engine.url}/health", timeout=5).status_code == 200
            assert f.engines == [engine]
    finally:
        squatter.close()


def test_the_fleet_never_hands_out_a_port_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Free ports are picked before each engine binds them, so the OS may offer a port again for the
    next engine; seen: one engine's HTTP port was the previous engine's replay port, and its /health
    never answered. Here the OS offers the first engine's ports again for the second."""
    import sim.fleet as fleet_module

    offered = iter([40_000, 40_100, 40_200, 40_000, 40_100, 40_200, 40_300, 40_400, 40_500])
    monkeypatch.setattr(fleet_module, "free_port", lambda host="127.0.0.1": next(offered))
    fleet = Fleet(tmp_path)
    handed = [fleet._ports(i) for i in range(2)]
    ports = [p for triple in handed for p in triple]
    assert len(set(ports)) == 6, handed
