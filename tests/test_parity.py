"""Tokenizer parity as a live check (router/parity.py): the rule on counts, and the wired router in
front of real simulated engines with a mismatched tokenizer (a BPE that is not the engines') against
the matching one: metric, /ready warning, distrusted index, the cause in the log."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvcore import sim_tokenizer
from router.config import ConfigError, load_config
from router.parity import PromptParity
from router.service import build_router_app
from sim.fleet import PROFILES, Fleet, FleetEngine
from sim.vllm_model import write_model_dir
from tests.conftest import ThreadedServer


def test_persistent_mismatch_is_distrusted_and_clears_after_a_window_of_agreement() -> None:
    parity = PromptParity(tail_tokens=4, window=4, min_mismatches=2)
    parity.observe("e0", 100, 103)  # within the tail: agreement
    parity.observe("e0", 128, 960)
    assert not parity.distrusts("e0")  # one disagreement is not persistent
    parity.observe("e0", 128, 1952)
    assert parity.distrusted() == {"e0"}
    assert "truncates or pads" in parity.ready_detail()["e0"]
    for _ in range(3):
        parity.observe("e0", 200, 200)
    assert parity.distrusts("e0")  # a mismatch is still in the window
    parity.observe("e0", 200, 200)
    assert parity.distrusted() == set()
    families = {f.name: f for f in parity.collect()}
    samples = {tuple(s.labels.values()): s.value for s in families["kvroute_prompt_token_checks"].samples}
    assert samples[("e0", "match")] == 5 and samples[("e0", "mismatch")] == 2


@pytest.mark.parametrize(
    ("pairs", "cause"),
    [
        ([(50, 60), (70, 80), (90, 100), (20, 30)], "10 more tokens on every request"),
        ([(50, 100), (70, 130), (90, 190), (20, 39)], "tokens per router token"),
    ],
)
def test_cause_names_the_pattern(pairs: list[tuple[int, int]], cause: str) -> None:
    parity = PromptParity(tail_tokens=2, window=4, min_mismatches=4)
    for router_tokens, engine_tokens in pairs:
        parity.observe("e1", router_tokens, engine_tokens)
    assert cause in parity.ready_detail()["e1"]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="min_mismatches"):
        PromptParity(window=2, min_mismatches=3)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[FleetEngine]]:
    with Fleet(tmp_path_factory.mktemp("parity-fleet")) as fleet:
        yield fleet.start(1, replace(PROFILES["tiny"], time_scale=100.0))


def _router(
    engines: list[FleetEngine], tokenizer: dict[str, Any], serve: Callable[..., ThreadedServer]
) -> str:
    data = {
        "engines": [e.fleet_entry() for e in engines],
        "tokenizer": tokenizer,
        "policy": {"name": "tier_cost"},
        "log_level": "warning",
    }
    return serve(build_router_app(load_config(environ={}, overrides=data))).url


def _chat(url: str, n: int) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    for i in range(n):
        client.chat.completions.create(
            model=sim_tokenizer.NAME,
            messages=[{"role": "user", "content": sim_tokenizer.filler_text(40 + 30 * i, seed=i)}],
            max_tokens=2,
        )


def _mismatch_metric(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("kvroute_prompt_token_mismatch{"):
            out[line.split('engine="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def test_a_foreign_tokenizer_is_reported_and_its_engine_index_distrusted(
    engines: list[FleetEngine],
    serve_asgi: Callable[..., ThreadedServer],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The router tokenises with a BPE; the simulated engine with its own byte tokenizer."""
    model_dir = write_model_dir(tmp_path / "model")
    url = _router(engines, {"backend": "hf", "path": str(model_dir)}, serve_asgi)
    with caplog.at_level(logging.WARNING, logger="kvroute.parity"):
        _chat(url, 5)
    ready = httpx.get(f"{url}/ready").json()["events"]
    assert ready["ok"] is False
    assert "tokens per router token" in ready["prompt_token_mismatch"]["e0"]
    assert _mismatch_metric(url) == {"e0": 1.0}
    explain = httpx.post(
        f"{url}/v1/route/explain",
        json={"model": sim_tokenizer.NAME, "messages": [{"role": "user", "content": "hello"}]},
    ).json()
    assert [e["index_trusted"] for e in explain["engines"]] == [False]
    assert any("tokenizer parity lost" in r.getMessage() for r in caplog.records)


def test_the_engines_own_tokenizer_agrees(
    engines: list[FleetEngine], serve_asgi: Callable[..., ThreadedServer]
) -> None:
    url = _router(engines, {"backend": "sim"}, serve_asgi)
    _chat(url, 5)
    ready = httpx.get(f"{url}/ready").json()["events"]
    assert ready["prompt_token_mismatch"] == {}
    assert _mismatch_metric(url) == {"e0": 0.0}


def test_the_parity_settings_come_from_the_config(
    engines: list[FleetEngine], serve_asgi: Callable[..., ThreadedServer], tmp_path: Path
) -> None:
    """tokenizer.parity_*: with a tolerance wider than the foreign BPE's difference the same
    traffic that is flagged above is accepted (the setting reaches the live check)."""
    model_dir = write_model_dir(tmp_path / "model")
    tokenizer = {"backend": "hf", "path": str(model_dir), "parity_tail_tokens": 100_000}
    url = _router(engines, tokenizer, serve_asgi)
    _chat(url, 5)
    assert httpx.get(f"{url}/ready").json()["events"]["prompt_token_mismatch"] == {}
    assert _mismatch_metric(url) == {"e0": 0.0}


@pytest.mark.parametrize(
    "bad",
    [{"parity_tail_tokens": -1}, {"parity_window": 0}, {"parity_window": 4, "parity_min_mismatches": 5}],
)
def test_bad_parity_settings_are_a_config_error(bad: dict[str, int]) -> None:
    with pytest.raises(ConfigError, match="parity_min_mismatches <= parity_window"):
        load_config(
            environ={}, overrides={"engines": [{"id": "e0", "url": "http://127.0.0.1:1"}], "tokenizer": bad}
        )
