"""Server stages in the DES (sim/frontend.py): vLLM's API server and the router as single-server
FIFO queues in front of the engine cores, checked in virtual time against hand-computed times."""

from __future__ import annotations

import random

import pytest

from sim.des import SimConfig, simulate
from sim.engine import EngineProfile
from sim.fleets import EngineSpec, FleetSpec
from sim.frontend import FifoServer, ServerStage
from sim.workloads import Conversation, Turn, Workload

#: One engine whose steps are easy to compute by hand: 10 ms per step, 1,000 prefill tokens/s,
#: 1 us of attention per (token, context token) pair, free decodes.
PROFILE = EngineProfile(
    block_size=16,
    num_gpu_blocks=400,
    step_overhead_s=0.01,
    prefill_tokens_per_s=1000.0,
    prefill_attention_s_per_token_ctx=1e-6,
    decode_s_per_seq=0.0,
    hbm_bytes_per_s=float("inf"),
)
#: The prefill step of an uncached 320-token prompt.
PREFILL_320_S = 0.01 + 0.32 + 320 * 319 / 2 * 1e-6
CFG = SimConfig(scrape_interval_s=0)


def fleet(api: ServerStage | None = None, router: ServerStage | None = None) -> FleetSpec:
    return FleetSpec([EngineSpec("e0", PROFILE)], api_server=api, router_stage=router)


def two_requests(second_at_s: float, output_tokens: int = 1) -> Workload:
    """Two single-turn conversations of 320 uncached tokens each: at 0 s and at ``second_at_s``."""
    a = Conversation("A", [Turn(320, output_tokens, list(range(20)), at_s=0.0)])
    b = Conversation("B", [Turn(320, output_tokens, list(range(100, 120)), at_s=0.0)], start_s=second_at_s)
    return Workload("two", 16, [a, b])


def test_stage_costs_and_fifo_server() -> None:
    stage = ServerStage(request_s=0.05, request_s_per_token=1e-4, output_s_per_token=0.02)
    assert stage.request_cost_s(320) == pytest.approx(0.082)
    assert stage.output_cost_s(3) == pytest.approx(0.06)
    server = FifoServer()
    assert server.serve(1.0, 0.5) == 1.5
    assert server.serve(1.2, 0.5) == 2.0  # waited behind the first job
    assert server.serve(3.0, 0.1) == pytest.approx(3.1)  # idle server: starts on arrival
    assert server.busy_s == pytest.approx(1.1)
    bad_fields = (
        {"request_s": -0.1},
        {"output_s_per_token": float("nan")},
        {"request_s_per_token": "1"},
        {"stall_sigma": -1},
    )
    for bad in bad_fields:
        with pytest.raises(ValueError, match="finite number >= 0"):
            ServerStage(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown ServerStage fields per_chunk_s"):
        ServerStage.from_dict({"per_chunk_s": 1.0}, "api_server")
    assert ServerStage.from_dict({"request_s": 0.5}, "api_server") == ServerStage(request_s=0.5)


def test_api_server_delays_the_first_token_by_its_request_and_output_work() -> None:
    plain = simulate(two_requests(10.0), "round_robin", fleet(), CFG)
    assert plain.ttfts_s == pytest.approx([PREFILL_320_S, PREFILL_320_S])
    stage = ServerStage(request_s=0.05, request_s_per_token=1e-4, output_s_per_token=0.02)
    staged = simulate(two_requests(10.0), "round_robin", fleet(api=stage), CFG)
    # Read and tokenized (0.05 + 320 x 1e-4 s) before the core sees it; its token sent 0.02 s later.
    assert staged.ttfts_s == pytest.approx([0.082 + PREFILL_320_S + 0.02] * 2)
    assert staged.hit == plain.hit


def test_requests_queue_for_the_api_server_in_arrival_order() -> None:
    # Both sent at 0: B is read only after A (0.082 s each), so it reaches the core at 0.164 s; the
    # same run without the stage but with the requests arriving at 0.082 and 0.164 s gives the
    # engine-core part of each TTFT.
    stage = ServerStage(request_s=0.05, request_s_per_token=1e-4)
    staged = simulate(two_requests(0.0), "round_robin", fleet(api=stage), CFG)
    shifted = Workload(
        "shifted",
        16,
        [
            Conversation("A", [Turn(320, 1, list(range(20)), at_s=0.0)], start_s=0.082),
            Conversation("B", [Turn(320, 1, list(range(100, 120)), at_s=0.0)], start_s=0.164),
        ],
    )
    core_part = simulate(shifted, "round_robin", fleet(), CFG).ttft_by_request_s
    assert staged.ttft_by_request_s["A#0"] == pytest.approx(0.082 + core_part["A#0"])
    assert staged.ttft_by_request_s["B#0"] == pytest.approx(0.164 + core_part["B#0"])
    assert staged.ttft_by_request_s["B#0"] > staged.ttft_by_request_s["A#0"] + 0.08


def test_a_request_waits_while_the_api_server_streams_another_requests_tokens() -> None:
    # A's token leaves the core at 0.082 + PREFILL_320_S = 0.46304 s and keeps the API server busy
    # for 0.5 s; B, sent at 0.5 s, is read from 0.96304 s on.
    stage = ServerStage(request_s=0.05, request_s_per_token=1e-4, output_s_per_token=0.5)
    res = simulate(two_requests(0.5), "round_robin", fleet(api=stage), CFG)
    a_first = 0.082 + PREFILL_320_S
    b_at_core = a_first + 0.5 + 0.082
    assert res.ttft_by_request_s["A#0"] == pytest.approx(a_first + 0.5)
    assert res.ttft_by_request_s["B#0"] == pytest.approx(b_at_core + PREFILL_320_S + 0.5 - 0.5)


def test_router_stage_adds_its_request_and_relay_work_after_the_api_server() -> None:
    api = ServerStage(request_s=0.05, request_s_per_token=1e-4, output_s_per_token=0.02)
    router = ServerStage(request_s=0.03, request_s_per_token=1e-5, output_s_per_token=0.01)
    res = simulate(two_requests(10.0), "round_robin", fleet(api=api, router=router), CFG)
    assert res.ttfts_s == pytest.approx([0.0332 + 0.082 + PREFILL_320_S + 0.02 + 0.01] * 2)
    only_router = simulate(two_requests(10.0), "round_robin", fleet(router=router), CFG)
    assert only_router.ttfts_s == pytest.approx([0.0332 + PREFILL_320_S + 0.01] * 2)


def test_the_next_turn_waits_for_the_last_token_to_reach_the_client() -> None:
    # One conversation, two turns of 3 output tokens, think time 1 s. The core makes a token every
    # 10 ms (one prefill step, then decode steps of 10 ms); the API server sends one per 20 ms, so
    # the tokens queue: a turn's last token reaches the client 3 x 0.02 s after the core's first
    # token instead of 2 x 0.01 s + 0.02 s - 0.04 s later per turn, and the second turn, sent 1 s
    # after that, starts 0.04 s later.
    first = Turn(320, 3, list(range(20)))
    second = Turn(480, 3, list(range(30)), think_time_s=1.0)
    wl = Workload("conv", 16, [Conversation("A", [first, second])], concurrency=1)
    plain = simulate(wl, "round_robin", fleet(), CFG)
    stage = ServerStage(output_s_per_token=0.02)
    staged = simulate(wl, "round_robin", fleet(api=stage), CFG)
    assert plain.virtual_s == pytest.approx(
        PREFILL_320_S + 0.02 + 1.0 + plain.ttft_by_request_s["A#1"] + 0.02
    )
    assert staged.ttft_by_request_s["A#0"] == pytest.approx(PREFILL_320_S + 0.02)
    assert staged.ttft_by_request_s["A#1"] == pytest.approx(plain.ttft_by_request_s["A#1"] + 0.02)
    assert staged.virtual_s == pytest.approx(plain.virtual_s + 2 * 0.04)


def test_a_stall_delays_a_request_without_holding_the_api_server() -> None:
    # Both sent at 0 with a 0.5 s stall and no work: neither waits for the other's stall, so both
    # reach the core at 0.5 s. With 0.5 s of work instead, B reaches it only at 1.0 s.
    stalled = simulate(two_requests(0.0), "round_robin", fleet(api=ServerStage(stall_s=0.5)), CFG)
    shifted = Workload(
        "shifted",
        16,
        [
            Conversation("A", [Turn(320, 1, list(range(20)), at_s=0.0)], start_s=0.5),
            Conversation("B", [Turn(320, 1, list(range(100, 120)), at_s=0.0)], start_s=0.5),
        ],
    )
    core_part = simulate(shifted, "round_robin", fleet(), CFG).ttft_by_request_s
    for rid in ("A#0", "B#0"):
        assert stalled.ttft_by_request_s[rid] == pytest.approx(0.5 + core_part[rid])
    # B's prefill waits for A's (0.5 + 2 x PREFILL_320_S) when stalled; after 1.0 s of queue when
    # the same time is work.
    assert stalled.ttft_by_request_s["B#0"] == pytest.approx(0.5 + 2 * PREFILL_320_S)
    worked = simulate(two_requests(0.0), "round_robin", fleet(api=ServerStage(request_s=0.5)), CFG)
    assert worked.ttft_by_request_s["B#0"] == pytest.approx(1.0 + PREFILL_320_S)


def test_stall_noise_is_seeded_and_keeps_the_median() -> None:
    stage = ServerStage(stall_s=0.1, stall_sigma=0.8)
    draws = [stage.stall_draw_s(random.Random(7)) for _ in range(2)]
    assert draws[0] == draws[1]  # same seed, same draw
    rng = random.Random(1)
    many = sorted(stage.stall_draw_s(rng) for _ in range(4001))
    assert many[2000] == pytest.approx(0.1, rel=0.1)
    assert many[3600] > 0.2  # the p90 of a sigma-0.8 log-normal is 2.8x its median
    runs = [
        simulate(two_requests(0.0), "round_robin", fleet(api=stage), SimConfig(seed=s, scrape_interval_s=0))
        for s in (1, 1, 2)
    ]
    assert runs[0].ttfts_s == runs[1].ttfts_s != runs[2].ttfts_s
