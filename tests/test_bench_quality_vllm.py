"""The pieces of ``bench_quality_live --backend vllm-cpu`` without vLLM: simulated engines stand in for
the real fleets (they serve the same /reset_prefix_cache, KV events and usage), so the
reset-before-every-run, the fleet a ``@priority`` target runs on, the event counting and the rotated
interleaving are checked in ``make test``; the real engines are ``make test-vllm``'s business."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from loadtest.bench_quality_live import (
    QUALITY_PROFILE,
    Backend,
    FleetFile,
    Run,
    cached_by_tier_delta,
    reset_prefix_caches,
    scrape_router_counters,
    split_like,
    split_spec,
    variant_of,
    vllm_runs,
)
from router.metrics import RouterMetrics
from sim.fleet import Fleet, FleetEngine
from sim.vllm_cpu import storage_pool_of
from tests.conftest import ThreadedServer

#: Fast simulated engines, no CPU/STORAGE tier (as the default real vLLM fleet), a GPU pool that two
#: ladder conversations overflow.
STAND_IN = replace(QUALITY_PROFILE, gpu_blocks=400, cpu_blocks=0, storage_blocks=0, time_scale=10.0)


@pytest.fixture(scope="module")
def fleets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, FleetFile]]:
    """An fcfs and a priority fleet of 2 simulated engines each, read back from their fleet files as
    the bench reads running real fleets. Started once for the module's tests: each run of the bench
    empties the fleet's prefix caches first (``vllm_runs``), as it does on real fleets, and the reset
    test reads one engine's cache only after its own reset."""
    tmp_path = tmp_path_factory.mktemp("quality-fleets")
    with Fleet(tmp_path / "fcfs") as fcfs, Fleet(tmp_path / "prio") as prio:
        fcfs.start(2, STAND_IN)
        prio.start(2, replace(STAND_IN, scheduling_policy="priority"))
        yield {
            "fcfs": FleetFile.read(fcfs.write_fleet_file(tmp_path / "fcfs.json")),
            "priority": FleetFile.read(prio.write_fleet_file(tmp_path / "prio.json")),
        }


def _chat(engine: FleetEngine, text: str) -> int:
    """Cached prompt tokens the engine reports for one chat request."""
    body = {"model": engine.model, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    resp = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=30)
    resp.raise_for_status()
    return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def _queries(engine: FleetEngine) -> float:
    text = httpx.get(engine.url + "/metrics", timeout=10).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("vllm:prefix_cache_queries_total")
    )


def test_a_target_spec_names_its_engines_scheduling() -> None:
    assert split_spec("kvroute:tier_cost@priority") == ("kvroute:tier_cost", "priority")
    assert split_spec("vllm-router:kv_aware") == ("vllm-router:kv_aware", "")
    with pytest.raises(ValueError, match="scheduling policy"):
        split_spec("kvroute:tier_cost@lifo")
    with pytest.raises(ValueError, match="kvroute policy"):
        split_spec("kvroute:nope@priority")


def test_a_variant_is_a_kvroute_config_named_in_the_target() -> None:
    assert split_spec("kvroute:tier_cost#pool8@priority") == ("kvroute:tier_cost", "priority")
    assert variant_of("kvroute:tier_cost#pool8@priority") == "pool8"
    assert variant_of("kvroute:tier_cost@priority") == ""
    with pytest.raises(ValueError, match="kvroute targets only"):
        split_spec("sglang-router:cache_aware#pool8")


def test_a_variants_config_reaches_its_router(fleets: dict[str, FleetFile], tmp_path: Path) -> None:
    """The same policy with and without a variant whose prior prefill rate is 1,000x too slow: the
    variant's router predicts far longer TTFTs than the engines take (its TTFT / predicted ratio
    collapses); a variant file that did not reach ``kvroute serve`` would leave the two alike."""
    slow = tmp_path / "slow.toml"
    slow.write_text("[costs.priors]\nprefill_tokens_per_s = 20.0\n")
    cells = [("ladder", 2, "kvroute:tier_cost"), ("ladder", 2, "kvroute:tier_cost#slow")]
    backend = Backend("stand-in", "sim", "", STAND_IN.block_size, {"slow": str(slow)})
    plain, variant = vllm_runs(
        cells, dict(fleets), backend, run_time_s=4, think_mean_s=0.05, peers_dir=tmp_path / "peers",
        out=tmp_path / "out", on_run=lambda run: None,
    )  # fmt: skip
    assert not plain.error and not variant.error, (plain.error, variant.error)
    assert variant.ttft_over_predicted < plain.ttft_over_predicted / 10, (plain, variant)
    assert plain.escalations == 0 == variant.escalations, (plain, variant)


def test_the_escalation_count_is_read_from_the_routers_own_metrics(
    serve_asgi: Callable[..., ThreadedServer],
) -> None:
    """A run's escalations come from the counter the router increments (``RouterMetrics.escalated``),
    summed over its engines: a name that drifted from the router's would read 0."""
    metrics = RouterMetrics()
    for engine_id in ("e0", "e0", "e1"):
        metrics.escalated(engine_id)
    app = FastAPI()

    @app.get("/metrics")
    async def exposition() -> Response:
        return Response(metrics.render(), media_type="text/plain")

    server = serve_asgi(app)
    assert scrape_router_counters(server.url, ("kvroute_escalations_total",)) == {
        "kvroute_escalations_total": 3.0
    }


def test_reset_empties_an_engines_prefix_cache(fleets: dict[str, FleetFile]) -> None:
    """What makes every run start cold: after the reset, the same prompt finds nothing cached."""
    engine = fleets["fcfs"].engines[0]
    text = "the same long prompt " * 60
    _chat(engine, text)
    assert _chat(engine, text) > 0
    reset_prefix_caches([engine])
    assert _chat(engine, text) == 0


def test_reset_retries_while_vllm_refuses_and_names_dev_mode_when_absent(
    serve_asgi: Callable[..., ThreadedServer], tmp_path: Path
) -> None:
    """vLLM answers success false while blocks are held (retry), and 404 without VLLM_SERVER_DEV_MODE."""
    answers = [False, False, True]
    asked: list[str] = []
    app = FastAPI()

    @app.post("/reset_prefix_cache")
    async def reset(reset_external: str = "") -> JSONResponse:
        asked.append(reset_external)
        return JSONResponse({"success": answers.pop(0)})

    server = serve_asgi(app)
    engine = FleetEngine("v0", server.url, "m", "", "", "", "", 32, 0, "")
    reset_prefix_caches([engine], timeout_s=30)
    assert answers == [] and asked == ["true"] * 3  # the CPU tier (vLLM's connector) emptied too
    # A STORAGE pool's folder (vLLM's fs tier, kept across resets): its block files go, its
    # config.json stays; a folder named by no engine is left alone.
    pool, other = tmp_path / "kv-storage", tmp_path / "other"
    for folder in (pool, other):
        (folder / "ns" / "ab" / "cd_g0").mkdir(parents=True)
        (folder / "ns" / "config.json").write_text("{}")
        (folder / "ns" / "ab" / "cd_g0" / "abcd.bin").write_bytes(b"kv")
    answers.append(True)
    reset_prefix_caches([replace(engine, storage_pool=storage_pool_of(str(pool)))], timeout_s=30)
    assert [p.name for p in pool.rglob("*") if p.is_file()] == ["config.json"]
    assert sorted(p.name for p in other.rglob("*") if p.is_file()) == ["abcd.bin", "config.json"]
    bare = serve_asgi(FastAPI())
    with pytest.raises(RuntimeError, match="--dev-mode"):
        reset_prefix_caches([replace(engine, url=bare.url)])


@pytest.mark.slow
def test_vllm_runs_measure_each_target_on_its_fleet_and_count_evictions(
    fleets: dict[str, FleetFile], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cells = [("ladder", 2, "kvroute:kv_fixed_credit@priority"), ("ladder", 2, "kvroute:round_robin")]
    scratch = tmp_path / "tmp"  # where the runs' folders go: a good run's is removed (none were)
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    seen: list[Run] = []
    before = {k: sum(_queries(e) for e in f.engines) for k, f in fleets.items()}
    runs = vllm_runs(
        cells, dict(fleets), Backend("stand-in", "sim", "", STAND_IN.block_size), run_time_s=4,
        think_mean_s=0.05, peers_dir=tmp_path / "peers", out=tmp_path / "out", on_run=seen.append,
    )  # fmt: skip
    assert seen == runs and [r.target for r in runs] == [c[2] for c in cells]
    for r in runs:
        assert not r.error, r.error
        assert r.turns > 0 and r.failures == 0
        # the engines' usage, not a router's guess: a share, and the ladder's later turns hit
        assert r.cached is not None and 0 < r.cached["GPU"] < r.prompt_tokens
        assert r.stored_blocks > 0 and r.removed_blocks > 0, "the small pool must evict, and it be seen"
        # the engines' own TTFT histogram, read as this run's delta: one observation per turn
        # (the stand-in serves that histogram only, in model seconds)
        assert set(r.phases) == {"engine_ttft"} and r.phases["engine_ttft"][2] == r.turns, r.phases
    after = {k: sum(_queries(e) for e in f.engines) for k, f in fleets.items()}
    assert after["priority"] > before["priority"] and after["fcfs"] > before["fcfs"]
    assert list(scratch.iterdir()) == []


def test_repeats_are_interleaved_in_a_rotated_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Repeat r runs every target once, the order shifted by r (no router always goes first)."""
    import loadtest.bench_quality_live as bench

    order: list[str] = []

    def fake_runs(cells: list[tuple[str, int, str]], *args: object, **kwargs: object) -> list[Run]:
        order.extend(c[2] for c in cells)
        return []

    class NoFleets:
        def __init__(self, *args: object) -> None:
            pass

        def __enter__(self) -> tuple[dict[str, object], Path]:
            return {
                "fcfs": FleetFile(tmp_path, [FleetEngine("v0", "", "m", "", "", "", "", 32, 0, "")])
            }, tmp_path

        def __exit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(bench, "vllm_runs", fake_runs)
    monkeypatch.setattr(bench, "vllm_fleets", NoFleets)
    targets = "kvroute:round_robin,kvroute:tier_cost,sglang-router:cache_aware"
    bench.main(
        ["--backend", "vllm-cpu", "--targets", targets, "--repeats", "3", "--out", str(tmp_path / "o")]
    )
    a, b, c = targets.split(",")
    assert order == [a, b, c, b, c, a, c, a, b]


def test_explain_probe_summary_counts_moves_and_prices_them_from_the_explain_before_the_turn() -> None:
    """A later turn that left its history's engine is a move; its parts are read from the explain
    taken just before it, for the history's engine and for the engine that served it."""
    from loadtest.explain_probe import summarise

    def turn(conv: str, k: int, engine: str, home_cost: float = 0.0, other_cost: float = 0.0) -> dict:
        engines = [
            {
                "engine_id": "v0",
                "prefix_tokens": 960,
                "in_flight": 2,
                "scores": {"cost_s": home_cost, "load_s_gpu": 0.01},
            },
            {"engine_id": "v1", "prefix_tokens": 0, "in_flight": 0, "scores": {"cost_s": other_cost}},
        ]
        return {
            "conversation": conv,
            "turn": k,
            "engine": engine,
            "ttft_s": 0.1 * (k + 1),
            "prompt_tokens": 1000,
            "cached_tokens": 500 if k else 0,
            "explain": {"engines": engines},
        }

    records = [turn("a", 0, "v0"), turn("a", 1, "v0"), turn("a", 2, "v1", home_cost=0.4, other_cost=0.3)]
    records += [turn("b", 1, "v0"), turn("b", 0, "v0")]  # completion order need not be turn order
    s = summarise(records)
    assert (s["later_turns"], s["stayed"], s["moved"]) == (3, 2, 1)
    moved = s["moves_median"]
    assert moved["cost_s"] == {"history_engine": 0.4, "chosen": 0.3}
    assert moved["in_flight"] == {"history_engine": 2.0, "chosen": 0.0}
    assert moved["load_s"]["history_engine"] == 0.01  # per-tier load parts are summed
    assert s["cached_share"] == 1500 / 5000


def test_the_phase_table_gives_each_targets_medians_and_skips_runs_without_phases() -> None:
    # Catches a table that mixes targets, takes the mean for the median, or lists a run that read
    # no engine histograms (a simulated back-end's) as zeros.
    from loadtest.bench_quality_live import fmt_phases

    def run(target: str, p50: float, queue_p99: float) -> Run:
        r = Run("ladder", 48, target, "vllm-cpu", ttft_p50_s=p50, ttft_p99_s=2 * p50)
        r.phases = {"engine_ttft": [p50 / 2, p50, 10.0], "queue": [0.1, queue_p99, 10.0]}
        return r

    runs = [run("a", 0.1, 1.0), run("a", 0.3, 3.0), run("a", 0.2, 8.0), run("b", 0.5, 0.5)]
    runs.append(Run("ladder", 48, "c", "sim", ttft_p50_s=1.0))  # no phases: not in the table
    rows = fmt_phases(runs).splitlines()[2:]
    assert len(rows) == 2
    a, b = (row.split(" | ") for row in rows)
    assert a[2] == "a" and a[3] == "3" and a[4] == "0.200 [0.100-0.300] / 0.400 [0.200-0.600]"
    assert a[6] == "0.100 [0.100-0.100] / 3.000 [1.000-8.000]" and a[7].startswith("-")
    assert b[2] == "b" and b[3] == "1"


def test_cached_tokens_by_tier_from_either_engines_sources() -> None:
    """The simulator's sources are tier names, vLLM's are device / host / disk: both land in
    GPU / CPU / STORAGE, as differences of two scrapes; a real run's total (the turns' usage) is
    split in the counters' proportions. Catches vLLM's "device" hits counted as CPU hits."""
    before = {"device": 100.0, "host": 0.0, "disk": 10.0, "external_unspecified": 0.0}
    after = {"device": 400.0, "host": 200.0, "disk": 110.0, "external_unspecified": 0.0}
    assert cached_by_tier_delta(before, after) == {"GPU": 300.0, "CPU": 200.0, "STORAGE": 100.0}
    assert cached_by_tier_delta({}, {"GPU": 5.0, "STORAGE": 1.0}) == {"GPU": 5.0, "CPU": 0.0, "STORAGE": 1.0}
    assert split_like(120.0, {"GPU": 300.0, "CPU": 200.0, "STORAGE": 100.0}) == {
        "GPU": 60.0,
        "CPU": 40.0,
        "STORAGE": 20.0,
    }
    assert split_like(7.0, {"GPU": 0.0, "CPU": 0.0, "STORAGE": 0.0}) == {
        "GPU": 7.0,
        "CPU": 0.0,
        "STORAGE": 0.0,
    }


def test_a_given_fleet_with_a_storage_pool_on_disk_is_refused(tmp_path: Path) -> None:
    """The bench empties the STORAGE folders of the fleets it starts; a given fleet's pool (somebody
    else's files) it will not touch, and without emptying it one run's history would reach the next:
    refused with the way out. Catches a bench that deletes files it does not own, or silently
    measures warm pools."""
    import argparse

    from loadtest.bench_quality_live import vllm_fleets
    from router.config import EngineConfig, write_fleet_file

    fleet_file = tmp_path / "fleet.json"
    pool = storage_pool_of(str(tmp_path / "kv"))
    write_fleet_file(fleet_file, [EngineConfig(id="v0", url="http://127.0.0.1:9", storage_pool=pool)])
    args = argparse.Namespace(fleet_file=fleet_file, priority_fleet_file=None, model_dir=tmp_path)
    with pytest.raises(SystemExit, match="start the fleets here with --storage"), vllm_fleets(args, {"fcfs"}):
        pass


def test_a_stopped_fleets_logs_go_to_the_results_and_its_folder_goes(tmp_path: Path) -> None:
    """The bench's vLLM fleets work in a temp folder (model folder, engine logs, the STORAGE pool's
    block files). Once a fleet stops, its engine logs are copied beside the results and the folder
    is removed. Catches the leak it had (every fleet's folder left in /tmp) and logs lost with it."""
    from loadtest.bench_quality_live import keep_logs_and_remove

    workdir = tmp_path / "vllmq-fcfs-x"
    (workdir / "model").mkdir(parents=True)
    (workdir / "kv-storage" / "ab").mkdir(parents=True)
    (workdir / "kv-storage" / "ab" / "block").write_bytes(b"\0" * 4096)
    for engine in ("v0", "v1"):
        (workdir / f"{engine}.log").write_text(f"{engine} says INFO Started server process\n")
    logs_to = tmp_path / "out" / "engine-logs" / "fcfs"
    keep_logs_and_remove(workdir, logs_to)
    assert not workdir.exists()
    assert sorted(p.name for p in logs_to.iterdir()) == ["v0.log", "v1.log"]
    assert (logs_to / "v1.log").read_text() == "v1 says INFO Started server process\n"


def test_an_interrupted_runs_folder_goes_and_a_failed_runs_stays(tmp_path: Path, monkeypatch) -> None:
    """A run's temp folder: Ctrl-C or SIGTERM (the bench turns it into SystemExit) removes it, since
    no result will name it; an error keeps it, for the logs that explain it. Catches the folder a
    stopped bench left in /tmp, and a fix that deletes a failure's evidence."""
    import tempfile

    from loadtest.bench_quality_live import run_folder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folders: list[Path] = []
    for raised in (SystemExit(143), KeyboardInterrupt(), RuntimeError("engine died")):
        with pytest.raises(type(raised)), run_folder() as workdir:
            folders.append(workdir)
            (workdir / "router.log").write_text("routing\n")
            raise raised
    assert [f.exists() for f in folders] == [False, False, True]
    with run_folder() as workdir:
        pass
    assert workdir.exists() and workdir.parent == tmp_path
