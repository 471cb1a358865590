"""The deployment files: compose.yaml (docker-compose config, and the vLLM flags the router relies
on), the router config it mounts, nginx's upstreams, Prometheus's config and alert rules (promtool),
and the Grafana dashboard: every query parses (promtool) and every metric it names exists, either
in a live router's /metrics (router + simulated engine + Redis, scraped here) or in vLLM's list."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvcore import sim_tokenizer
from loadtest.redis_server import RedisServer, redis_binary
from router.config import load_config
from router.service import build_router_app
from sim.fleet import PROFILES, Fleet
from tests.conftest import ThreadedServer

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvroute.json"

#: vLLM's /metrics names the dashboard may use (the vLLM contract, section 5: vLLM 0.33.0).
VLLM_METRICS = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:prompt_tokens_cached_by_source_total",
    "vllm:kv_offload_load_bytes_total",
    "vllm:kv_offload_load_time_total",
    "vllm:kv_offload_store_bytes_total",
    "vllm:kv_offload_store_time_total",
    "vllm:cache_config_info",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_count",
    "vllm:time_to_first_token_seconds_sum",
}
_METRIC = re.compile(r"\b((?:kvroute_|vllm:)[a-zA-Z0-9_:]+)")


def _compose() -> dict[str, Any]:
    """compose.yaml with ``${VAR:-default}`` replaced by the default (as with no .env file)."""
    text = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", lambda m: m.group(1), COMPOSE.read_text())
    return yaml.safe_load(text)


def _flag(command: list[str], name: str) -> str:
    for arg in command:
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}":
            return "true"
    raise AssertionError(f"--{name} missing from {command}")


def _dashboard_exprs() -> list[tuple[str, str]]:
    doc = json.loads(DASHBOARD.read_text())
    out = []
    for panel in doc["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def _alert_exprs() -> list[tuple[str, str]]:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [(r["alert"], r["expr"]) for g in rules["groups"] for r in g["rules"]]


# ----------------------------------------------------------------------------- compose


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_docker_compose_config_accepts_the_file() -> None:
    result = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_vllm_services_have_gpus_and_the_flags_the_router_needs() -> None:
    services = _compose()["services"]
    vllm = {name: s for name, s in services.items() if str(s.get("image", "")).find("vllm/vllm-openai") >= 0}
    assert len(vllm) >= 2
    volumes_seen = []
    gpus = set()
    for name, service in vllm.items():
        assert service["profiles"] == ["gpu"], name
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
        gpus.update(devices[0]["device_ids"])
        command = service["command"]
        assert _flag(command, "enable-prompt-tokens-details") == "true"
        events = json.loads(_flag(command, "kv-events-config"))
        assert events["enable_kv_cache_events"] is True
        pub_port = int(events["endpoint"].rsplit(":", 1)[1])
        replay_port = int(events["replay_endpoint"].rsplit(":", 1)[1])
        # DP rank r adds r to both ports: keep them at least 8 ranks apart.
        assert replay_port - pub_port >= 8
        transfer = json.loads(_flag(command, "kv-transfer-config"))
        extra = transfer["kv_connector_extra_config"]
        assert transfer["kv_connector"] == "OffloadingConnector"
        assert extra["cpu_bytes_to_use"] > 0 and extra["self_describing_kv_events"] is True
        (tier,) = extra["secondary_tiers"]
        assert tier["type"] == "fs" and tier["enable_kv_events"] is True
        mounts = [v for v in service["volumes"] if v.endswith(":" + tier["root_dir"])]
        assert len(mounts) == 1, f"{name}: the fs tier dir must be a mounted volume"
        volumes_seen.append(mounts[0].split(":")[0])
    assert len(set(volumes_seen)) == 1, "every engine must mount the same fs-tier volume (shared pool)"
    assert len(gpus) == len(vllm), "one GPU per engine"


def test_sim_profile_stands_in_for_every_engine_under_the_same_name() -> None:
    services = _compose()["services"]

    def aliases(profile: str) -> set[str]:
        return {
            alias
            for s in services.values()
            if s.get("profiles") == [profile]
            for alias in s["networks"]["default"]["aliases"]
        }

    assert aliases("gpu") == aliases("sim") == {"engine-0", "engine-1"}
    for service in services.values():
        if service.get("profiles") == ["sim"]:
            assert service["command"][0] == "engine"
            events = json.loads(_flag(service["command"], "kv-events-config"))
            assert events["replay_endpoint"].endswith(":5567")
    config = load_config(DEPLOY / "router" / "router.toml", environ={})
    assert {httpx.URL(e.url).host for e in config.engines} == aliases("sim")
    assert {e.storage_pool for e in config.engines} == {"shared-fs"}
    # The router sends priorities only to engines it is told schedule by them; an engine that
    # does not (vLLM's fcfs default) would answer every such request with a 400.
    policies = {httpx.URL(e.url).host: e.scheduling_policy for e in config.engines}
    for name, service in services.items():
        if service.get("profiles") in (["gpu"], ["sim"]):
            command = [str(arg) for arg in service["command"]]
            for alias in service["networks"]["default"]["aliases"]:
                assert _flag(command, "scheduling-policy") == policies[alias], name


def test_two_routers_behind_the_balancer_share_redis_and_prometheus_scrapes_all() -> None:
    services = _compose()["services"]
    routers = sorted(n for n, s in services.items() if s.get("command", [""])[0] == "serve")
    assert routers == ["router-1", "router-2"]
    for name in routers:
        env = services[name]["environment"]
        assert env["KVROUTE_SHARED_REDIS_URL"].startswith("redis://redis:")
    nginx = (DEPLOY / "lb" / "nginx.conf").read_text()
    assert sorted(re.findall(r"server (router-\d):8000", nginx)) == routers
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in prometheus["scrape_configs"]}
    assert targets["kvroute"] == [f"{r}:8000" for r in routers]
    assert targets["vllm"] == ["engine-0:8000", "engine-1:8000"]
    for name in ("redis", "grafana", "prometheus", "locust", "lb"):
        assert name in services


# ----------------------------------------------------------------------------- prometheus


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (Debian prometheus)")
def test_promtool_accepts_config_rules_and_every_dashboard_query(tmp_path: Path) -> None:
    result = subprocess.run(
        ["promtool", "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The dashboard's queries as recording rules: promtool parses each PromQL expression.
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:q{i}", "expr": expr}
                    for i, (_, expr) in enumerate(_dashboard_exprs())
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ----------------------------------------------------------------------------- dashboard names


@pytest.fixture(scope="module")
def live_metric_names(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[set[str], set[str]]]:
    """(router sample names, simulated engine sample names) after real traffic."""
    if redis_binary() is None:
        pytest.skip("redis-server binary not found (apt-get install redis-server)")
    workdir = tmp_path_factory.mktemp("deploy-live")
    profile = replace(PROFILES["tiny"], time_scale=100.0)
    with RedisServer(workdir / "redis") as redis, Fleet(workdir / "fleet") as fleet:
        engines = fleet.start(1, profile, storage_pool="pool0")
        config = load_config(
            environ={},
            overrides={
                "engines": [e.fleet_entry() for e in engines],
                "tokenizer": {"backend": "sim"},
                "experiment": {"name": "d", "arms": [{"name": "tc", "policy": "tier_cost"}]},
                "costs": {"scrape_interval_s": 0.2},
                "shared": {"redis_url": redis.url},
                "log_level": "warning",
            },
        )
        server = ThreadedServer(build_router_app(config)).start()
        try:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            messages = [{"role": "user", "content": sim_tokenizer.filler_text(200, seed=3)}]
            for _ in range(3):
                stream = client.chat.completions.create(
                    model=sim_tokenizer.NAME,
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=4,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                assert [chunk for chunk in stream]
            time.sleep(0.5)  # a scrape of the engine and a batch of events
            router_text = httpx.get(f"{server.url}/metrics").text
            engine_text = httpx.get(f"{engines[0].url}/metrics").text
        finally:
            server.stop()

    def names(text: str) -> set[str]:
        # Families without samples yet (a labelled counter nobody incremented) count by their type.
        out: set[str] = set()
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
        for family in text_string_to_metric_families(text):
            out.update(s.name for s in family.samples)
            out.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
        return out

    yield names(router_text), names(engine_text)


@pytest.mark.slow
def test_every_dashboard_and_alert_metric_exists(live_metric_names: tuple[set[str], set[str]]) -> None:
    router_names, engine_names = live_metric_names
    # The simulated engine must expose what vLLM exposes, or the sim profile shows empty panels.
    assert VLLM_METRICS - {n for n in VLLM_METRICS if "time_to_first" in n} <= engine_names
    missing = []
    for title, expr in [*_dashboard_exprs(), *_alert_exprs()]:
        for name in _METRIC.findall(expr):
            if name not in router_names and name not in VLLM_METRICS:
                missing.append(f"{title}: {name}")
    assert not missing, f"unknown metric names: {missing}"
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert {p["title"] for p in panels if p["type"] == "row"} >= {
        "Requests",
        "Engine load",
        "KV events and index health",
        "Router replicas and shared state",
    }


@pytest.mark.slow
def test_operations_page_documents_every_router_metric_and_alert(
    live_metric_names: tuple[set[str], set[str]],
) -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    families = {re.sub(r"_(bucket|count|sum|created|total)$", "", n) for n in live_metric_names[0]}
    undocumented = sorted(f for f in families if f.startswith("kvroute_") and f not in text)
    assert not undocumented, f"docs/operations.md lacks {undocumented}"
    assert [a for a, _ in _alert_exprs() if a not in text] == []
