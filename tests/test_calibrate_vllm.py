"""The calibration fit (loadtest/calibrate_vllm.py) on samples generated from known parameters, and
the profile file it writes read back by the simulator (sim/des.py --engine-profile)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest

from loadtest.calib_compare import block_chain
from loadtest.calibrate_vllm import (
    DecodeSample,
    LoadedRequest,
    PrefillSample,
    fit_server_stages,
    fit_step_model,
    median_samples,
    replay_loaded,
)
from sim.des_cli import _plan, build_parser
from sim.engine import EngineCore, EngineProfile, SimRequest
from sim.fleets import load_engine_profile
from sim.frontend import ServerStage

TRUE = {
    "request_overhead_s": 0.02,
    "step_overhead_s": 0.012,
    "prefill_s_per_token": 1 / 9000,
    "prefill_attention_s_per_token_ctx": 4e-9,
    "decode_s_per_seq": 0.003,
    "decode_s_per_ctx_token": 2e-7,
}


def _samples(noise: float, seed: int = 0) -> tuple[list[PrefillSample], list[DecodeSample]]:
    rng = random.Random(seed)
    t = TRUE
    prefill = []
    for p in (60, 250, 700, 1500, 2500, 4000) * 3:
        s = (
            t["request_overhead_s"]
            + t["step_overhead_s"] * math.ceil(p / 2048)  # chunked prefill: 2,048 tokens a step
            + p * t["prefill_s_per_token"]
            + p * (p - 1) / 2 * t["prefill_attention_s_per_token_ctx"]
        )
        prefill.append(PrefillSample(p, s * (1 + rng.gauss(0, noise))))
    decode = []
    for n in (1, 2, 4):
        for ctx in (400, 900, 1600):
            c = n * ctx
            s = t["step_overhead_s"] + n * t["decode_s_per_seq"] + c * t["decode_s_per_ctx_token"]
            decode.append(DecodeSample(n, c, s * (1 + rng.gauss(0, noise))))
    return prefill, decode


def test_fit_recovers_the_true_parameters_from_exact_samples() -> None:
    fit = fit_step_model(*_samples(noise=0.0))
    for name, value in TRUE.items():
        assert fit.coefficients[name] == pytest.approx(value, rel=1e-6), name
    assert max(abs(r) for r in fit.prefill_residuals + fit.decode_residuals) < 1e-9


def test_a_decode_fit_that_does_not_follow_its_samples_is_flagged() -> None:
    # vLLM's CPU build sends a stream's tokens in bursts (round q36): the gaps between them are
    # near 0 or whole batches, not decode steps. Catches a profile written from such samples with
    # no word that its decode terms are unreliable, and a warning on a sound fit.
    from loadtest.calibrate_vllm import fit_warnings, format_fit

    prefill, decode = _samples(noise=0.0)
    assert fit_warnings(fit_step_model(prefill, decode)) == []
    # q36's second calibration of a vLLM 0.32 CPU engine (docs/results/q36/raw-w.json, the medians
    # per prompt size and batch it printed).
    prefill = [PrefillSample(p, t) for p, t in ((109, 0.0106), (483, 0.0135), (1084, 0.0246))]
    prefill += [PrefillSample(p, t) for p, t in ((1837, 0.0458), (2584, 0.0769), (3334, 0.1093))]
    bursty = [DecodeSample(1, 683, 0.00151), DecodeSample(2, 1389, 0.00018), DecodeSample(4, 2118, 0.00232)]
    fit = fit_step_model(prefill, bursty)
    warnings = fit_warnings(fit)
    assert len(warnings) == 1 and warnings[0].startswith("the decode terms do not follow"), warnings
    assert "WARNING: the decode terms" in format_fit(fit, fit.profile_fields(1024), prefill, bursty)


def test_fit_with_noise_stays_close_and_reports_the_residuals() -> None:
    fit = fit_step_model(*_samples(noise=0.02, seed=3))
    assert fit.coefficients["prefill_s_per_token"] == pytest.approx(TRUE["prefill_s_per_token"], rel=0.1)
    assert fit.coefficients["step_overhead_s"] == pytest.approx(TRUE["step_overhead_s"], rel=0.15)
    assert fit.coefficients["decode_s_per_seq"] == pytest.approx(TRUE["decode_s_per_seq"], rel=0.3)
    assert 0.005 < max(abs(r) for r in fit.prefill_residuals) < 0.1


def test_fit_never_returns_a_negative_coefficient() -> None:
    # Decode steps that do not grow with context but shrink a little: an unconstrained fit gives a
    # negative context term; the model has none, so it is fixed at 0 and the rest refitted.
    prefill, _ = _samples(noise=0.0)
    decode = [DecodeSample(n, c, 0.02 + 0.003 * n - 1e-7 * c) for n in (1, 2, 4) for c in (400 * n, 1600 * n)]
    fit = fit_step_model(prefill, decode)
    assert all(v >= 0 for v in fit.coefficients.values())
    assert fit.coefficients["decode_s_per_ctx_token"] == 0.0
    assert fit.profile_fields(1024)["hbm_bytes_per_s"] == math.inf


def test_fit_refuses_samples_that_cannot_separate_the_terms() -> None:
    prefill, decode = _samples(noise=0.0)
    with pytest.raises(ValueError, match="distinct prompt lengths"):
        fit_step_model([s for s in prefill if s.prompt_tokens in (60, 250)], decode)
    with pytest.raises(ValueError, match="distinct batch sizes"):
        fit_step_model(prefill, [s for s in decode if s.batch == 2])


def test_profile_fields_drive_the_engine_model_to_the_fitted_times(tmp_path: Path) -> None:
    fit = fit_step_model(*_samples(noise=0.0))
    fields = {"kv_bytes_per_token": 1024, **fit.profile_fields(1024)}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"engine_profile": fields, "measured_on": {"engine": "v0"}}))
    loaded = load_engine_profile(path)
    engine = EngineCore("e0", EngineProfile(**loaded, block_size=32, num_gpu_blocks=400))
    engine.add_request(SimRequest("r", list(range(1000, 3000)), max_tokens=4))
    first = engine.step()  # one prefill step of 2,000 uncached tokens from an empty context
    p = 2000
    want = (
        TRUE["step_overhead_s"]
        + p * TRUE["prefill_s_per_token"]
        + p * (p - 1) / 2 * TRUE["prefill_attention_s_per_token_ctx"]
    )
    assert first.duration_s == pytest.approx(want, rel=1e-6)
    second = engine.step()  # one decode over 2,001 tokens of context
    want = TRUE["step_overhead_s"] + TRUE["decode_s_per_seq"] + 2001 * TRUE["decode_s_per_ctx_token"]
    assert second.duration_s == pytest.approx(want, rel=1e-3)


def test_sim_cli_takes_the_profile_and_refuses_bad_files(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"step_overhead_s": 0.05, "prefill_tokens_per_s": 5000.0}))
    args = build_parser().parse_args(
        [
            "--engine-profile",
            str(good),
            "--concurrency",
            "4",
            "--policies",
            "round_robin",
            "--engines",
            "2",
            "--engine-variation",
            "0",
        ]
    )
    runs, _ = _plan(args)
    prof = runs[0].fleet.engines[0].profile
    assert (prof.step_overhead_s, prof.prefill_tokens_per_s) == (0.05, 5000.0)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"step_overhead": 0.05}))
    with pytest.raises(ValueError, match="unknown EngineProfile fields step_overhead"):
        load_engine_profile(bad)
    bad.write_text(json.dumps({"block_size": 32}))
    with pytest.raises(ValueError, match="set by the fleet options"):
        load_engine_profile(bad)
    bad.write_text(json.dumps({"prefill_tokens_per_s": -1}))
    with pytest.raises(ValueError, match="prefill_tokens_per_s must be positive"):
        load_engine_profile(bad)


def test_sim_cli_builds_a_live_fleets_pools_and_escalation(tmp_path: Path) -> None:
    # A real fleet's setting in the DES (round q36): exactly N GPU blocks an engine, no CPU tier,
    # priority engines escalating late turns. Catches the ladder sizing the pools from
    # --hbm-conversations anyway, a CPU tier left in, or the escalation not reaching SimConfig.
    argv = ["--concurrency", "4", "--policies", "round_robin", "--engines", "2", "--engine-variation", "0"]
    argv += ["--storage", "none", "--block-size", "32", "--gpu-blocks", "1240", "--cpu-ratio", "0"]
    args = build_parser().parse_args([*argv, "--scheduling-policy", "priority", "--escalate-after-s", "1.35",
                                      "--escalate-pick", "route"])  # fmt: skip
    runs, _ = _plan(args)
    profiles = [e.profile for e in runs[0].fleet.engines]
    assert [(p.num_gpu_blocks, p.num_cpu_blocks, p.block_size) for p in profiles] == [(1240, 0, 32)] * 2
    assert runs[0].fleet.storage_pool_blocks == 0
    assert (runs[0].config.escalate_after_s, runs[0].config.escalate_pick) == (1.35, "route")
    assert runs[0].workload.duration_s is None and len(runs[0].workload.conversations) == 8  # 2 x 4
    timed, _ = _plan(build_parser().parse_args([*argv, "--duration-s", "300"]))
    assert timed[0].workload.duration_s == 300.0  # conversations start for 300 s (a Locust run)
    assert len(timed[0].workload.conversations) > 8
    stages = tmp_path / "stages.json"
    stages.write_text(json.dumps({"api_server": {"request_s": 0.03, "output_s_per_token": 0.002}}))
    staged, _ = _plan(build_parser().parse_args([*argv, "--server-stages", str(stages)]))
    api = staged[0].fleet.api_server
    assert api is not None and (api.request_s, api.output_s_per_token) == (0.03, 0.002)
    assert staged[0].fleet.router_stage is None and runs[0].fleet.api_server is None
    stages.write_text(json.dumps({"engine_profile": {}}))
    with pytest.raises(ValueError, match="no api_server or router_stage"):
        _plan(build_parser().parse_args([*argv, "--server-stages", str(stages)]))
    with pytest.raises(ValueError, match="--gpu-blocks: ladder options"):
        _plan(build_parser().parse_args(["--trace", "mooncake", "--gpu-blocks", "100"]))
    with pytest.raises(ValueError, match="--duration-s must be > 0"):
        _plan(build_parser().parse_args([*argv, "--duration-s", "0"]))
    default, _ = _plan(build_parser().parse_args(argv[:8]))
    two = default[0].fleet.engines[0].profile
    assert two.num_cpu_blocks == 2 * two.num_gpu_blocks  # (the default CPU tier is kept)
    with pytest.raises(ValueError, match="add --scheduling-policy priority"):
        _plan(build_parser().parse_args([*argv, "--escalate-after-s", "1"]))
    with pytest.raises(ValueError, match="--gpu-blocks must be >= 1"):
        _plan(build_parser().parse_args([*argv[:-4], "--gpu-blocks", "0"]))
    with pytest.raises(ValueError, match="--cpu-ratio must be >= 0"):
        _plan(build_parser().parse_args([*argv, "--cpu-ratio", "-1"]))


def test_median_samples_drop_a_stalled_request_and_group_near_equal_lengths() -> None:
    # Three repeats of two prompt sizes (lengths differ by a few tokens: the random tag), one of them
    # stalled 8x by a busy machine; the median per size ignores it.
    prefill = [PrefillSample(p, t) for p, t in ((1835, 0.06), (1840, 0.48), (1838, 0.061), (106, 0.02))]
    prefill += [PrefillSample(108, 0.021), PrefillSample(107, 0.019)]
    decode = [DecodeSample(1, 700, 0.005), DecodeSample(1, 690, 0.04), DecodeSample(1, 680, 0.0052)]
    p, d = median_samples(prefill, decode)
    assert [(s.prompt_tokens, s.ttft_s) for s in p] == [(107, 0.02), (1838, 0.061)]
    assert [(s.batch, s.context_tokens, s.step_s) for s in d] == [(1, 690, 0.0052)]


def test_block_chain_ids_share_exactly_the_shared_full_blocks() -> None:
    a = list(range(100))
    b = [*range(70), 999, *range(71, 100)]  # differs in block 2 (tokens 64..95)
    ca, cb = block_chain(a, 32), block_chain(b, 32)
    assert len(ca) == 3  # the partial 4th block has no id
    assert ca[:2] == cb[:2] and ca[2] != cb[2]
    assert block_chain(a[32:], 32)[0] != ca[1]  # same tokens, other parent: another id


# -- the server stages (sim/frontend.py) fitted to front-end runs -----------------------------------

STAGE_PROFILE = EngineProfile(
    block_size=32,
    num_gpu_blocks=400,
    step_overhead_s=0.004,
    prefill_tokens_per_s=40_000.0,
    prefill_attention_s_per_token_ctx=4e-9,
    decode_s_per_seq=0.0003,
    hbm_bytes_per_s=float("inf"),
    max_num_batched_tokens=2048,
)


def _loaded_runs() -> list[LoadedRequest]:
    """Front-end runs as the calibration makes them: one stream (requests 0.5 s apart), then 3
    streams whose requests arrive while the others' answers stream, straight and through the router;
    32-token answers. TTFTs are filled in by the caller."""
    sizes = (400, 900, 1500, 2100)
    out = []
    for via in ("direct", "router"):
        for k in range(3):
            out.append(LoadedRequest(1, "", sizes[k], 32, 0.5 * k, 0.0, 0.0, via))
        for k in range(9):
            start = 0.25 * (k // 3) + 0.06 * (k % 3)
            out.append(LoadedRequest(3, "", sizes[k % 4], 32, start, 0.0, 0.0, via))
    return out


@pytest.mark.slow
def test_server_stage_fit_recovers_known_api_server_and_router_parameters() -> None:
    api = ServerStage(request_s=0.03, output_s_per_token=0.002, stall_s=0.02)
    router = ServerStage(request_s=0.012, output_s_per_token=0.0007, stall_s=0.004)
    runs = _loaded_runs()
    ttfts = replay_loaded(runs, ["v0", "v1"], STAGE_PROFILE, api, router)
    # The stages matter here: a loaded request waits for other requests' work and tokens.
    bare = replay_loaded(runs, ["v0", "v1"], STAGE_PROFILE, None, None)
    assert min(t - b for t, b in zip(ttfts, bare, strict=True)) > 0.05
    live = [dataclasses.replace(r, ttft_s=t) for r, t in zip(runs, ttfts, strict=True)]
    fit = fit_server_stages(live, ["v0", "v1"], STAGE_PROFILE)
    got, got_router = fit.api_server, fit.router_stage
    assert got.request_s == pytest.approx(api.request_s, rel=0.03)
    assert got.stall_s == pytest.approx(api.stall_s, rel=0.05)
    # Weakest: the tokens' cost shows only where a request meets another's stream (10% off seen).
    assert got.output_s_per_token == pytest.approx(api.output_s_per_token, rel=0.15)
    assert got.stall_sigma < 0.02  # exact samples: nothing left unexplained
    # The router's share of a TTFT is small next to the API server's here: its total per request is
    # recovered, not its split into work, stall and tokens (the fit left the split where it started).
    assert got_router is not None
    total = router.request_s + router.stall_s + router.output_s_per_token
    got_total = got_router.request_s + got_router.stall_s + got_router.output_s_per_token
    assert got_total == pytest.approx(total, rel=0.03)
    assert fit.api_error < 3e-4 and fit.router_error < 3e-4  # within ~2% of every TTFT


def test_server_stage_fit_needs_two_concurrencies() -> None:
    one = [r for r in _loaded_runs() if r.concurrency == 1]
    with pytest.raises(ValueError, match=">= 2 concurrencies"):
        fit_server_stages(one, ["v0", "v1"], STAGE_PROFILE)
