"""End to end: the official openai SDK -> router (real uvicorn) -> recording upstream engines."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from router.app import create_app
from router.config import load_config
from tests.conftest import OpenAIUpstream, ThreadedServer

MODEL = "test-model"


def start_router(
    serve_asgi: Callable[..., ThreadedServer], engines: list[tuple[OpenAIUpstream, str]], **overrides: Any
) -> ThreadedServer:
    data: dict[str, Any] = {
        "engines": [{"id": u.name, "url": url, "model": MODEL} for u, url in engines],
        "health": {"interval_s": 0},
        **overrides,
    }
    return serve_asgi(create_app(load_config(environ={}, overrides=data)))


@pytest.fixture
def fleet(serve_asgi, upstreams):
    engines = upstreams(3)
    router = start_router(serve_asgi, engines, policy={"name": "round_robin"})
    return engines, router


def test_sync_chat_non_stream_and_stream(fleet) -> None:
    engines, router = fleet
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="sk-test", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5
    )
    answer = raw.parse()
    assert answer.choices[0].message.content == "tok0 tok1 tok2"
    assert raw.headers["x-kvroute-policy"] == "round_robin"
    assert raw.headers["x-kvroute-arm"] == "default"
    served_by = raw.headers["x-kvroute-engine"]
    assert served_by in {u.name for u, _ in engines}
    assert answer.id.startswith(served_by)

    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == "tok0 tok1 tok2 "
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 7
    # Round robin over 3 engines: two requests hit two different engines.
    assert sorted(len(u.bodies) for u, _ in engines) == [0, 1, 1]


async def test_async_completions_stream_and_non_stream(fleet) -> None:
    engines, router = fleet
    async with openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="sk-test", max_retries=0) as client:
        done = await client.completions.create(model=MODEL, prompt="once upon", max_tokens=3)
        assert done.choices[0].text == "tok0 tok1 tok2"
        stream = await client.completions.create(model=MODEL, prompt=[1, 2, 3], stream=True)
        texts = [c.choices[0].text async for c in stream if c.choices]
        assert "".join(texts) == "tok0 tok1 tok2 "
        chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
        assert chat.choices[0].message.content == "tok0 tok1 tok2"
    assert sum(len(u.bodies) for u, _ in engines) == 3


def test_vllm_extras_and_original_bytes_reach_engine(fleet) -> None:
    engines, router = fleet
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="sk-test", max_retries=0)
    extras = {
        "session_id": "conv-42",
        "cache_salt": "tenant-a",
        "vllm_xargs": {"kv_cache_report_mode": "full"},
        "min_tokens": 2,
        "ignore_eos": True,
        "priority": -1,
        "kv_transfer_params": {"x": [1, 2]},
        "return_token_ids": True,
    }
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        extra_body=extras,
        extra_headers={"x-session-id": "conv-42"},
    )
    engine = next(u for u, _ in engines if u.name == raw.headers["x-kvroute-engine"])
    received = json.loads(engine.bodies[-1])
    for key, value in extras.items():
        assert received[key] == value
    assert engine.headers[-1]["x-session-id"] == "conv-42"
    assert engine.headers[-1]["authorization"] == "Bearer sk-test"

    # Byte-exact passthrough: odd spacing, key order and unicode escapes survive untouched.
    body = b'{ "model":"test-model",  "prompt" : "caf\\u00e9",\n "vllm_xargs": {"b":1,"a":2}, "zz": null}'
    resp = httpx.post(
        router.url + "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert resp.status_code == 200
    engine = next(u for u, _ in engines if u.name == resp.headers["x-kvroute-engine"])
    assert engine.bodies[-1] == body


def test_models_health_ready_metrics(fleet) -> None:
    _, router = fleet
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="sk-test", max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(router.url + "/health").status_code == 200
    ready = httpx.get(router.url + "/ready")
    assert ready.status_code == 200 and ready.json()["healthy_engines"] == 3
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a"}], stream=True
    ).close()
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "b"}])
    text = httpx.get(router.url + "/metrics").text
    assert 'kvroute_requests_total{arm="default",engine="e1",policy="round_robin",status="200"} 1.0' in text
    # The non-stream answer on e1 has no first token: latency and router time, no TTFT sample.
    assert 'kvroute_ttft_seconds_count{arm="default",engine="e1",policy="round_robin"}' not in text
    assert 'kvroute_request_latency_seconds_count{arm="default",engine="e1",policy="round_robin"} 1.0' in text
    assert 'kvroute_router_seconds_count{arm="default"} 2.0' in text
    assert 'kvroute_request_latency_seconds_count{arm="default",engine="e0",policy="round_robin"}' in text
    assert 'kvroute_in_flight{engine="e0"} 0.0' in text


def test_models_union_learned_from_engines(serve_asgi, upstreams) -> None:
    engines = upstreams(2)
    engines[1][0].model = "other-model"
    router = serve_asgi(
        create_app(
            load_config(
                environ={},
                overrides={
                    "engines": [{"id": u.name, "url": url} for u, url in engines],  # no model: learned
                    "health": {"interval_s": 0.05},
                },
            )
        )
    )
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="sk-test", max_retries=0)
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ids = sorted(m.id for m in client.models.list())
        if len(ids) == 2:
            break
        time.sleep(0.05)
    assert ids == ["other-model", MODEL]
    resp = client.chat.completions.with_raw_response.create(
        model="other-model", messages=[{"role": "user", "content": "a"}]
    )
    assert resp.headers["x-kvroute-engine"] == "e1"


def test_session_affinity_end_to_end(serve_asgi, upstreams) -> None:
    engines = upstreams(3)
    router = start_router(serve_asgi, engines, policy={"name": "session_affinity"})
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="sk-test", max_retries=0)
    for session in ("alice", "bob", "carol", "dave"):
        served = set()
        history: list[Any] = [{"role": "user", "content": f"I am {session}"}]
        for turn in range(3):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=history, user=session
            )
            served.add(raw.headers["x-kvroute-engine"])
            history += [
                {"role": "assistant", "content": raw.parse().choices[0].message.content},
                {"role": "user", "content": f"turn {turn}"},
            ]
        assert len(served) == 1, f"session {session} moved between engines: {served}"


def test_experiment_arms_header(serve_asgi, upstreams) -> None:
    engines = upstreams(2)
    router = start_router(
        serve_asgi,
        engines,
        experiment={
            "arms": [{"name": "a", "policy": "round_robin"}, {"name": "b", "policy": "least_loaded"}]
        },
    )
    arms = {}
    with httpx.Client(base_url=router.url) as client:  # one client: not a TLS context per request
        for i in range(40):
            resp = client.post(
                "/v1/chat/completions",
                headers={"x-session-id": f"s{i}"},
                json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
            )
            assert resp.status_code == 200
            arms[f"s{i}"] = (resp.headers["x-kvroute-arm"], resp.headers["x-kvroute-policy"])
    assert {a for a, _ in arms.values()} == {"a", "b"}
    assert all(p == {"a": "round_robin", "b": "least_loaded"}[a] for a, p in arms.values())
    again = httpx.post(
        router.url + "/v1/chat/completions",
        headers={"x-session-id": "s3"},
        json={"model": MODEL, "messages": [{"role": "user", "content": "y"}]},
    )
    assert again.headers["x-kvroute-arm"] == arms["s3"][0]  # sticky per session


def test_stream_with_null_stream_options_sends_one_key_and_keeps_the_usage(serve_asgi, upstreams) -> None:
    """``"stream_options": null`` is a body without options: the router's include_usage must
    replace it, not be spliced in next to it (vLLM reads duplicate keys as the last one, null,
    and sends no usage: the router lost that request's cached tokens)."""
    engines = upstreams(1)
    seen: list[Any] = []
    finished = threading.Event()  # the accounting runs after the write: wait for it

    class UsageObserver:
        def on_routed(self, ctx: Any) -> None: ...

        def on_first_byte(self, ctx: Any) -> None: ...

        def on_finished(self, ctx: Any) -> None:
            seen.append(ctx.usage)
            finished.set()

    config = load_config(
        environ={},
        overrides={
            "engines": [{"id": u.name, "url": url, "model": MODEL} for u, url in engines],
            "health": {"interval_s": 0},
        },
    )
    router = serve_asgi(create_app(config, observers=[UsageObserver()]))
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "stream": True,
        "stream_options": None,
    }
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        raw = b"".join(resp.iter_bytes())
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    assert events[-1] == b"data: [DONE]"
    assert all(b'"usage"' not in e for e in events), raw  # the client did not ask for usage
    sent = engines[0][0].bodies[-1]
    assert sent.count(b'"stream_options"') == 1, sent
    assert json.loads(sent)["stream_options"] == {"include_usage": True}
    assert finished.wait(30)
    assert seen and seen[-1] is not None and seen[-1]["prompt_tokens_details"]["cached_tokens"] == 7
