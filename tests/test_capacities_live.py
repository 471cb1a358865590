"""Tier capacities reach the policy live: two simulated engines with different GPU / CPU / STORAGE
sizes, the real router scraping their /metrics, horizon_cost pricing evictions from what it read.

The truth is the engines' own configuration (the FleetProfile each process was started with); the
router's config deliberately names another pool size, so a capacity taken from config instead of
the engine's report, or a scrape that never reaches the policy's ``EngineView.extra``, fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from kvcore.sim_tokenizer import NAME
from router.config import load_config
from router.service import build_router_app
from sim.fleet import Fleet, FleetEngine, FleetProfile
from tests.conftest import ThreadedServer

pytestmark = pytest.mark.slow  # engine processes

BLOCK_SIZE = 16
#: Per engine: (gpu_blocks, cpu_blocks, storage_blocks); storage is one shared pool per engine here.
SIZES = {"small": (96, 256, 3000), "big": (640, 1280, 5000)}
CONFIGURED_POOL_BLOCKS = 777  # what the router's config says: the engines' own report must win


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[FleetEngine]]:
    started: list[FleetEngine] = []
    with Fleet(tmp_path_factory.mktemp("capacities")) as fleet:
        for name, (gpu, cpu, storage) in SIZES.items():
            profile = FleetProfile(
                gpu_blocks=gpu,
                cpu_blocks=cpu,
                storage_blocks=storage,
                shared_storage=False,
                block_size=BLOCK_SIZE,
                time_scale=50.0,
                default_max_tokens=1,
            )
            started += fleet.start(1, profile, id_prefix=name, storage_pool=f"pool-{name}")
        yield started


def _explain(url: str) -> dict[str, Any]:
    body = {"model": NAME, "messages": [{"role": "user", "content": "where would this go?"}]}
    resp = httpx.post(f"{url}/v1/route/explain", json=body, timeout=5.0)
    assert resp.status_code == 200, resp.text
    return {e["engine_id"]: e["scores"] for e in resp.json()["engines"]}


def test_scraped_tier_capacities_reach_horizon_cost(
    serve_asgi: Callable[..., ThreadedServer], engines: list[FleetEngine]
) -> None:
    config = load_config(
        environ={},
        overrides={
            "engines": [e.fleet_entry() for e in engines],
            "policy": {"name": "horizon_cost"},
            "tokenizer": {"backend": "sim"},
            "index": {"storage_pool_blocks": CONFIGURED_POOL_BLOCKS},
            "costs": {"scrape_interval_s": 0.2},
            "log_level": "warning",
        },
    )
    url = serve_asgi(build_router_app(config)).url
    expected = {
        e.id: {
            "gpu_capacity_tokens": SIZES[e.id.rstrip("0123456789")][0] * BLOCK_SIZE,
            "cpu_capacity_tokens": SIZES[e.id.rstrip("0123456789")][1] * BLOCK_SIZE,
            "storage_capacity_tokens": SIZES[e.id.rstrip("0123456789")][2] * BLOCK_SIZE,
        }
        for e in engines
    }
    deadline = time.monotonic() + 20.0
    seen: dict[str, dict[str, float]] = {}
    while time.monotonic() < deadline:
        scores = _explain(url)
        seen = {
            engine_id: {k: v for k, v in s.items() if k.endswith("_capacity_tokens")}
            for engine_id, s in scores.items()
        }
        if all(len(v) == 3 for v in seen.values()) and len(seen) == len(engines):
            break
        time.sleep(0.2)
    assert seen == expected
