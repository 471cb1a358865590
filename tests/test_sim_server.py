"""The sim engine server over real HTTP on loopback, driven by the official openai SDK and httpx:
SSE format, usage with cached tokens, /tokenize, render, metrics, validation and disconnects."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvcore import sim_tokenizer as tokenizer
from sim.server import EngineServerConfig, ThreadedEngineServer, main
from sim.zmq_publisher import KVEventsConfig

MODEL = tokenizer.NAME


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedEngineServer]:
    cfg = EngineServerConfig(
        port=0, gpu_blocks=512, cpu_blocks=1024, max_model_len=2048, time_scale=200.0, engine_id="s0"
    )
    with ThreadedEngineServer(cfg) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ThreadedEngineServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http(server: ThreadedEngineServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30, trust_env=False) as c:
        yield c


def _metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        sample_labels = line[line.find("{") + 1 : line.rfind("}")] if "{" in line else ""
        if all(f'{k}="{v}"' in sample_labels for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"metric {name}{labels} not exposed"
    return total


def test_chat_multi_turn_cached_tokens_grow(client: openai.OpenAI) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": tokenizer.filler_text(60, seed=11)},
        {"role": "user", "content": tokenizer.filler_text(40, seed=12)},
    ]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)  # type: ignore[arg-type]
    assert first.object == "chat.completion" and first.choices[0].finish_reason == "length"
    assert first.usage is not None and first.usage.completion_tokens == 5
    assert first.usage.prompt_tokens == len(tokenizer.encode_chat(messages))
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    answer = first.choices[0].message.content
    assert answer and answer == tokenizer.decode(tokenizer.encode_text(answer))
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)  # type: ignore[arg-type]
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= 96  # turn 1's full blocks (>= 6 of 16 tokens) are reused
    assert cached % 16 == 0 and cached < second.usage.prompt_tokens


def test_chat_stream_with_usage_via_sdk(client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": tokenizer.filler_text(50, seed=3)}]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(tokenizer.encode_text(text)) == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 6 and last.usage.prompt_tokens == len(
        tokenizer.encode_chat(messages)
    )
    assert (
        last.usage.prompt_tokens_details is not None and last.usage.prompt_tokens_details.cached_tokens == 0
    )


def test_raw_sse_framing(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert all(p["object"] == "text_completion" for p in payloads)
    assert "usage" not in payloads[-1]  # no include_usage -> no usage chunk
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_completions_prompt_shapes(client: openai.OpenAI) -> None:
    one = client.completions.create(model=MODEL, prompt="abc def", max_tokens=2)
    assert len(one.choices) == 1 and one.usage is not None
    assert one.usage.prompt_tokens == len(tokenizer.encode_prompt("abc def"))
    many = client.completions.create(model=MODEL, prompt=["first prompt", "second one"], max_tokens=2)
    assert sorted(c.index for c in many.choices) == [0, 1]
    assert many.usage is not None and many.usage.completion_tokens == 4
    ids = client.completions.create(model=MODEL, prompt=[1, 1000, 1001, 1002], max_tokens=2)
    assert ids.usage is not None and ids.usage.prompt_tokens == 4
    lists = client.completions.create(model=MODEL, prompt=[[1, 1000], [1, 1001, 1002]], max_tokens=1)
    assert lists.usage is not None and lists.usage.prompt_tokens == 5 and len(lists.choices) == 2
    stream = client.completions.create(
        model=MODEL,
        prompt=["x y z", "u v w"],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finished == [0, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6


def test_tokenize_stable_under_prefix_extension(http: httpx.Client) -> None:
    turn1 = [{"role": "user", "content": "How do KV caches work?"}]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "They store keys."},
        {"role": "user", "content": "More."},
    ]
    r1 = http.post(
        "/tokenize", json={"model": MODEL, "messages": turn1, "add_generation_prompt": True}
    ).json()
    r2 = http.post(
        "/tokenize", json={"model": MODEL, "messages": turn2, "add_generation_prompt": True}
    ).json()
    assert r1["count"] == len(r1["tokens"]) and r1["max_model_len"] == 2048 and r1["token_strs"] is None
    assert r2["tokens"][: r1["count"]] == r1["tokens"]
    assert r1["tokens"] == tokenizer.encode_chat(turn1)
    render = http.post("/v1/chat/completions/render", json={"model": MODEL, "messages": turn2}).json()
    assert render["token_ids"] == r2["tokens"] and render["model"] == MODEL
    assert {"request_id", "sampling_params", "stream", "cache_salt"} <= set(render)
    crender = http.post("/v1/completions/render", json={"prompt": ["a", "bc"], "cache_salt": "t1"}).json()
    assert isinstance(crender, list) and [r["token_ids"] for r in crender] == [
        tokenizer.encode_prompt("a"),
        tokenizer.encode_prompt("bc"),
    ]
    assert crender[0]["cache_salt"] == "t1"
    p = http.post("/tokenize", json={"prompt": "plain text"}).json()
    assert p["tokens"] == tokenizer.encode_prompt("plain text")
    assert http.post("/detokenize", json={"tokens": p["tokens"]}).json()["prompt"].endswith("plain text")


def test_info_endpoints(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
    models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 2048
    assert http.get("/kv_event_sources").json() == {}  # events disabled on this server


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/chat/completions", "{not json", 400, "not valid JSON"),
        ("/v1/chat/completions", [1, 2], 400, "JSON object"),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
        (
            "/v1/chat/completions",
            {"model": "other", "messages": [{"role": "user", "content": "x"}]},
            404,
            "other",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000},
            400,
            "context",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"},
            400,
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            400,
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
            400,
            "temp",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "'n'"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "stream": "yes"},
            400,
            "stream",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x" * 7000}]},
            400,
            "context length",
        ),
        ("/v1/completions", {"prompt": 12}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
        ("/v1/completions", {"prompt": [-5]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream"),
        ("/tokenize", {"prompt": 3}, 400, "prompt"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_bad_inputs_are_openai_errors(
    http: httpx.Client, path: str, body: Any, status: int, needle: str
) -> None:
    raw = body if isinstance(body, str) else json.dumps(body)
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code"} and err["code"] == status
    assert needle.lower() in err["message"].lower()
    assert http.get("/health").status_code == 200  # still serving


def test_sdk_sees_errors_as_exceptions(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10**6
        )


def test_metrics_names_and_labels(http: httpx.Client, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt=tokenizer.filler_text(40), max_tokens=2)
    client.completions.create(model=MODEL, prompt=tokenizer.filler_text(40), max_tokens=2)
    text = http.get("/metrics").text
    labels = {"model_name": MODEL, "engine": "s0"}
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert 0 <= _metric(text, gauge, **labels)
    assert (
        _metric(text, "vllm:prefix_cache_queries_total", **labels)
        >= _metric(text, "vllm:prefix_cache_hits_total", **labels)
        > 0
    )
    assert _metric(text, "vllm:external_prefix_cache_queries_total", **labels) > 0
    _metric(text, "vllm:external_prefix_cache_hits_total", **labels)
    assert _metric(text, "vllm:prompt_tokens_cached_by_source_total", source="GPU", **labels) > 0
    assert _metric(text, "vllm:kv_offload_store_bytes_total", medium="CPU", **labels) > 0
    _metric(text, "vllm:kv_offload_load_bytes_total", medium="STORAGE", **labels)
    _metric(text, "vllm:kv_offload_load_time_total", medium="CPU", **labels)
    assert _metric(text, "vllm:kv_offload_store_time_total", medium="CPU", **labels) > 0
    assert _metric(text, "vllm:cache_config_info", block_size="16", num_gpu_blocks="512",
                   prefix_caching_hash_algo="sha256", **labels) == 1.0  # fmt: skip
    assert _metric(text, "vllm:time_to_first_token_seconds_count", **labels) >= 2


def test_client_disconnect_aborts_request() -> None:
    # Slow clock (1x) and a long answer: the request is still decoding when the client leaves.
    cfg = EngineServerConfig(port=0, gpu_blocks=256, time_scale=1.0, engine_id="slow")
    with (
        ThreadedEngineServer(cfg) as srv,
        httpx.Client(base_url=srv.url, timeout=30, trust_env=False) as http,
    ):
        body = {"prompt": "long answer please", "max_tokens": 5000, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    break
        assert _metric(http.get("/metrics").text, "vllm:num_requests_running") <= 1
        deadline = time.monotonic() + 10
        while _metric(http.get("/metrics").text, "vllm:num_requests_running") > 0:
            assert time.monotonic() < deadline, "aborted request still running after the client left"
            time.sleep(0.05)
        assert http.get("/health").status_code == 200


def test_zero_delay_mode() -> None:
    cfg = EngineServerConfig(port=0, zero_delay=True, zero_delay_output_tokens=3, engine_id="z")
    with ThreadedEngineServer(cfg) as srv, openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x") as c:
        r = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=50
        )
        assert r.usage is not None and r.usage.completion_tokens == 3
        chunks = list(
            c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
                stream_options={"include_usage": True},
            )
        )  # fmt: skip
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_reset_prefix_cache_empties_the_cpu_tier_only_with_reset_external() -> None:
    """vLLM's POST /reset_prefix_cache empties the GPU prefix cache, and with
    ``reset_external=true`` its offloading connector's CPU tier too (what a benchmark's cold start
    relies on). Catches a stand-in that ignores the parameter (the next run would start warm from
    CPU where vLLM starts cold)."""
    cfg = EngineServerConfig(port=0, gpu_blocks=64, cpu_blocks=64, max_model_len=1024, time_scale=200.0)
    prompt = tokenizer.filler_text(200, seed=5)
    with (
        ThreadedEngineServer(cfg) as srv,
        httpx.Client(base_url=srv.url, timeout=30, trust_env=False) as http,
    ):

        def cached() -> int:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            answer = http.post("/v1/completions", json=body)
            answer.raise_for_status()
            return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] or 0)

        assert cached() == 0
        assert http.post("/reset_prefix_cache").json() == {"success": True}
        assert cached() > 0  # from the CPU tier: the GPU pool was emptied
        reset = http.post("/reset_prefix_cache", params={"reset_external": "true"})
        assert reset.json() == {"success": True}
        assert cached() == 0


def test_cli_rejects_bad_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--kv-events-config", '{"enable_kv_cache_events": true, "bogus": 1}']) == 2
    assert "bogus" in capsys.readouterr().err


def test_kv_event_sources_replaces_wildcard_host() -> None:
    cfg = EngineServerConfig(
        port=0,
        gpu_blocks=64,
        kv_events=KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", topic="t"),
        engine_id="ev",
    )
    with ThreadedEngineServer(cfg) as srv:
        src = httpx.get(f"{srv.url}/kv_event_sources").json()
    assert src["0"]["endpoint"] == "tcp://127.0.0.1:0" and src["0"]["topic"] == "t"
