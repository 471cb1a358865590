"""The offline simulator and the live fleet agree: the same small ladder workload, run once through
``sim.des`` in virtual time and once through real engine processes behind the real router, gives
the same prompt-cache hit rate (within 3 percentage points) for policies whose choices do not depend
on timing.

Why not exact: in the DES, a turn resends the workload's assumed answer text while the live engine
generated its own, so the few blocks that straddle an answer may hit in one run and not the other.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from kvcore.sim_tokenizer import NAME
from loadtest.workloads import LadderConfig, Workload, ladder_workload
from router.config import load_config
from router.service import build_router_app
from sim.des import EngineSpec, FleetSpec, SimConfig, simulate
from sim.engine import EngineProfile
from sim.fleet import Fleet, FleetProfile
from tests.conftest import ThreadedServer

BLOCK = 16
GPU_BLOCKS = 96  # ~2.5 conversations per engine: evictions happen, so routing matters
TOLERANCE = 0.03


def _workload() -> Workload:
    return ladder_workload(
        LadderConfig(
            first_prompt_tokens=400,
            system_prefix_tokens=64,
            tokens_per_turn=100,
            turns=3,
            answer_min_tokens=16,
            answer_max_tokens=16,
            think_time_mean_s=0.0,
            concurrency=1,
            total_conversations=5,
            block_size=BLOCK,
        )
    )


def _des_hit_rate(workload: Workload, policy: str) -> float:
    profile = EngineProfile(block_size=BLOCK, num_gpu_blocks=GPU_BLOCKS, num_cpu_blocks=0)
    fleet = FleetSpec([EngineSpec(f"e{i}", profile) for i in range(2)], storage_pool_blocks=0)
    result = simulate(workload, policy, fleet, SimConfig(token_mode=True, seed=0))
    assert result.requests == workload.num_requests
    return result.hit_gpu + result.hit_cpu + result.hit_storage


def _live_hit_rate(
    workload: Workload, policy: str, tmp_path: Path, serve_asgi: Callable[..., ThreadedServer]
) -> tuple[float, int]:
    profile = FleetProfile(
        gpu_blocks=GPU_BLOCKS, cpu_blocks=0, storage_blocks=0, block_size=BLOCK, time_scale=50.0
    )
    prompt_total = cached_total = 0
    with Fleet(tmp_path / policy) as fleet:
        engines = fleet.start(2, profile)
        config = load_config(
            environ={},
            overrides={
                "engines": [e.fleet_entry() for e in engines],
                "policy": {"name": policy},
                "tokenizer": {"backend": "sim"},
                "health": {"interval_s": 0.5},
                "log_level": "warning",
            },
        )
        url = serve_asgi(build_router_app(config)).url
        for conv in workload.conversations:  # concurrency 1: one conversation after another
            client = openai.OpenAI(
                base_url=f"{url}/v1",
                api_key="x",
                max_retries=0,
                default_headers={"x-session-id": conv.conversation_id},
            )
            answers: list[str] = []
            for k, turn in enumerate(conv.turns):
                resp = client.chat.completions.create(
                    model=NAME,
                    messages=conv.messages(k, answers),  # type: ignore[arg-type]
                    max_tokens=turn.output_tokens,
                )
                assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
                prompt_total += resp.usage.prompt_tokens
                cached_total += resp.usage.prompt_tokens_details.cached_tokens or 0
                answers.append(resp.choices[0].message.content or "")
    return cached_total / prompt_total, prompt_total


@pytest.mark.parametrize(
    "policy", ["round_robin", "session_affinity", "kv_gpu", "kv_fixed_credit", "tier_cost"]
)
def test_des_and_live_fleet_agree_on_hit_rate(
    policy: str, tmp_path: Path, serve_asgi: Callable[..., ThreadedServer]
) -> None:
    workload = _workload()
    des = _des_hit_rate(workload, policy)
    live, prompt_tokens = _live_hit_rate(workload, policy, tmp_path, serve_asgi)
    expected_prompt = sum(t.prompt_tokens for c in workload.conversations for t in c.turns)
    assert prompt_tokens == expected_prompt  # the live prompts are the workload's, token for token
    assert 0.0 < des < 1.0
    print(f"{policy}: DES hit rate {des:.4f}, live {live:.4f}")
    assert abs(des - live) <= TOLERANCE, f"{policy}: DES hit rate {des:.3f} vs live {live:.3f}"
