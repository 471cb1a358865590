"""The offline simulator and the live fleet agree: the same small ladder workload, run once through
``sim.des`` in virtual time and once through real engine processes (at a tenth of real time)
behind the real router, streaming, gives the same prompt-cache hit rate (within 3 percentage
points) and the same TTFT p50 (within 25% + 15 ms) for round_robin, kv_gpu, kv_fixed_credit and
tier_cost. Both drive the same routing core (kvcore/core.py).

Why not exact: in the DES, a turn resends the workload's assumed answer text while the live engine
generated its own, so the few blocks that straddle an answer may hit in one run and not the other;
the live TTFT also carries HTTP, the router and the engine process's own CPU time (the 15 ms, in
model seconds at a time scale of 0.1: 150 ms of wall time).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from kvcore.sim_tokenizer import NAME
from kvcore.stats import percentile
from policies.tier_cost import TierCostPolicy
from router.config import load_config
from router.service import build_router_app
from sim.des import SimConfig, simulate
from sim.engine import EngineProfile
from sim.fleet import Fleet, FleetProfile
from sim.fleets import EngineSpec, FleetSpec
from sim.workloads import LadderConfig, Workload, ladder_workload
from tests.conftest import ThreadedServer

pytestmark = pytest.mark.slow  # live engine processes: ~15 s per policy

BLOCK = 16
GPU_BLOCKS = 200  # ~2 conversations per engine: evictions happen, so routing matters
TOLERANCE = 0.03
TTFT_REL_TOLERANCE = 0.25
TTFT_ABS_TOLERANCE_S = 0.015
#: The live engines run 10x slower than their model time: the router's, HTTP's and the engine
#: process's own CPU time shrink 10x in model seconds. At 0.25 that overhead (50-80 ms of wall
#: time at load 15 on 2 cores) took 20 of the 23 ms allowed and failed under more load; at 0.1 it
#: is 5-8 ms; what the test allows the DES itself (25% + 15 ms, model seconds) is unchanged.
TIME_SCALE = 0.1


def _workload() -> Workload:
    return ladder_workload(
        LadderConfig(
            first_prompt_tokens=400,
            system_prefix_tokens=64,
            tokens_per_turn=600,
            turns=3,
            answer_min_tokens=4,
            answer_max_tokens=4,
            think_time_mean_s=0.0,
            concurrency=1,
            total_conversations=5,
            block_size=BLOCK,
        )
    )


def _des_run(workload: Workload, policy: str) -> tuple[float, float]:
    profile = EngineProfile(block_size=BLOCK, num_gpu_blocks=GPU_BLOCKS, num_cpu_blocks=0)
    fleet = FleetSpec([EngineSpec(f"e{i}", profile) for i in range(2)], storage_pool_blocks=0)
    result = simulate(workload, policy, fleet, SimConfig(token_mode=True, seed=0))
    assert result.requests == workload.num_requests
    return result.hit_gpu + result.hit_cpu + result.hit_storage, result.ttft_p50_s


def _wall_params(policy: str) -> dict[str, float]:
    """tier_cost's fixed seconds, stretched like the engines' time (its other terms are rates)."""
    if policy != "tier_cost":
        return {}
    defaults = TierCostPolicy()
    return {
        "decode_s_per_running": defaults.decode_s_per_running / TIME_SCALE,
        "pressure_s_at_full": defaults.pressure_s_at_full / TIME_SCALE,
    }


def _live_run(
    workload: Workload, policy: str, tmp_path: Path, serve_asgi: Callable[..., ThreadedServer]
) -> tuple[float, int, float]:
    """(hit rate, prompt tokens, client-side TTFT p50 in model seconds) through the real router."""
    profile = FleetProfile(
        gpu_blocks=GPU_BLOCKS, cpu_blocks=0, storage_blocks=0, block_size=BLOCK, time_scale=TIME_SCALE
    )
    prompt_total = cached_total = 0
    ttfts: list[float] = []
    with Fleet(tmp_path / policy) as fleet:
        engines = fleet.start(2, profile)
        config = load_config(
            environ={},
            overrides={
                "engines": [e.fleet_entry() for e in engines],
                "policy": {"name": policy, "params": _wall_params(policy)},
                "tokenizer": {"backend": "sim"},
                "health": {"interval_s": 0.5},
                # The same fleet in wall seconds: priors = the engines' profile at this time scale
                # (the DES prices with the profile), scrapes as often as the DES's in model time.
                "costs": {
                    "priors": {"prefill_tokens_per_s": EngineProfile().prefill_tokens_per_s * TIME_SCALE},
                    "scrape_interval_s": SimConfig().scrape_interval_s / TIME_SCALE,
                },
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
                started = time.perf_counter()
                stream = client.chat.completions.create(
                    model=NAME,
                    messages=conv.messages(k, answers),  # type: ignore[arg-type]
                    max_tokens=turn.output_tokens,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                text, usage, first = [], None, None
                for chunk in stream:
                    if first is None:
                        first = time.perf_counter() - started
                    usage = chunk.usage or usage
                    text += [c.delta.content or "" for c in chunk.choices]
                assert first is not None and usage is not None and usage.prompt_tokens_details is not None
                ttfts.append(first * TIME_SCALE)  # wall seconds -> the engines' model seconds
                prompt_total += usage.prompt_tokens
                cached_total += usage.prompt_tokens_details.cached_tokens or 0
                answers.append("".join(text))
    return cached_total / prompt_total, prompt_total, percentile(ttfts, 50)


@pytest.mark.parametrize("policy", ["round_robin", "kv_gpu", "kv_fixed_credit", "tier_cost"])
def test_des_and_live_fleet_agree_on_hit_rate_and_ttft(
    policy: str, tmp_path: Path, serve_asgi: Callable[..., ThreadedServer]
) -> None:
    workload = _workload()
    des_hit, des_ttft_s = _des_run(workload, policy)
    live_hit, prompt_tokens, live_ttft_s = _live_run(workload, policy, tmp_path, serve_asgi)
    expected_prompt = sum(t.prompt_tokens for c in workload.conversations for t in c.turns)
    assert prompt_tokens == expected_prompt  # the live prompts are the workload's, token for token
    assert 0.0 < des_hit < 1.0
    print(
        f"{policy}: hit rate DES {des_hit:.4f} live {live_hit:.4f}; "
        f"TTFT p50 DES {des_ttft_s * 1000:.1f} ms live {live_ttft_s * 1000:.1f} ms"
    )
    assert abs(des_hit - live_hit) <= TOLERANCE, (
        f"{policy}: DES hit rate {des_hit:.3f} vs live {live_hit:.3f}"
    )
    allowed_s = TTFT_REL_TOLERANCE * des_ttft_s + TTFT_ABS_TOLERANCE_S
    assert abs(live_ttft_s - des_ttft_s) <= allowed_s, (policy, des_ttft_s, live_ttft_s)
