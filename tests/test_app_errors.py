"""Bad input and failing engines: every case answers an OpenAI-shaped JSON error, never a crash."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from router.app import create_app
from router.config import load_config
from tests.conftest import ThreadedServer, free_port

MODEL = "test-model"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}


def router_for(serve_asgi: Callable[..., ThreadedServer], urls: list[tuple[str, str]], **overrides: Any):
    data: dict[str, Any] = {
        "engines": [{"id": eid, "url": url, "model": MODEL} for eid, url in urls],
        "policy": {"name": "round_robin"},
        "health": {"interval_s": 0},
        **overrides,
    }
    return serve_asgi(create_app(load_config(environ={}, overrides=data)))


def dead_url() -> str:
    """A loopback URL where nothing listens (connection refused)."""
    return f"http://127.0.0.1:{free_port()}"


def assert_error(resp: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "code"}
    assert error["code"] == code
    assert error["message"]
    assert resp.headers["x-request-id"]
    return error


@pytest.fixture
def one_engine(serve_asgi, upstreams):
    ((upstream, url),) = upstreams(1)
    return upstream, router_for(
        serve_asgi, [("e0", url)], limits={"max_body_bytes": 4096, "read_timeout_s": 0.5}
    )


def test_malformed_json(one_engine) -> None:
    _, router = one_engine
    resp = httpx.post(
        router.url + CHAT,
        content=b'{"model": "test-model", "messages": [',
        headers={"x-request-id": "r1", **JSON},
    )
    assert_error(resp, 400, "invalid_json")
    assert resp.headers["x-request-id"] == "r1"
    assert_error(httpx.post(router.url + CHAT, content=b"[1, 2]", headers=JSON), 400, "invalid_json")


@pytest.mark.parametrize(
    "body, code",
    [
        ({"model": 7, "messages": MESSAGES}, "invalid_type"),
        ({"model": MODEL, "messages": "hi"}, "invalid_type"),
        ({"model": MODEL, "messages": [{"content": "no role"}]}, "invalid_type"),
        ({"model": MODEL, "messages": MESSAGES, "stream": "yes"}, "invalid_type"),
        ({"model": MODEL, "messages": MESSAGES, "max_tokens": "5"}, "invalid_type"),
    ],
)
def test_wrong_types(one_engine, body, code) -> None:
    upstream, router = one_engine
    assert_error(httpx.post(router.url + CHAT, json=body), 400, code)
    assert upstream.bodies == []


@pytest.mark.parametrize(
    ("field", "value", "what"),
    [
        ("max_tokens", 0, "an integer >= 1"),
        ("max_completion_tokens", -3, "an integer >= 1"),
        ("n", 2**31, "an integer >= 1"),
        ("temperature", -0.5, "a number >= 0"),
        ("top_p", 0, "a number in (0, 1]"),
        ("top_p", True, "a number in (0, 1]"),
    ],
)
def test_numbers_out_of_range_are_400s_naming_the_field(one_engine, field, value, what) -> None:
    """Each ranged number is checked when the body has it (the checks run only for the keys
    present): a field dropped from that table would be sent on to the engine."""
    upstream, router = one_engine
    sent = len(upstream.bodies)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, field: value}
    error = assert_error(httpx.post(router.url + CHAT, json=body), 400, "invalid_value")
    assert error["message"].startswith(f"'{field}' must be {what}")
    assert len(upstream.bodies) == sent
    # In range, the same field passes.
    body[field] = 1 if field != "temperature" else 0.5
    assert httpx.post(router.url + CHAT, json=body).status_code == 200


def test_integers_beyond_64_bits_in_the_conversation_start_are_forwarded(one_engine) -> None:
    """A valid JSON body may carry an integer MessagePack cannot hold (the session key hashes the
    conversation's start): the request is answered and forwarded whole, never a 500 (schemathesis
    found `{'': -9223372036854775809, 'role': ''}` as a message)."""
    upstream, router = one_engine
    for big in (-(2**63) - 1, 2**64, 10**30):
        sent = len(upstream.bodies)
        message = {"role": "user", "content": "hi", "x": big}
        resp = httpx.post(router.url + CHAT, json={"model": MODEL, "messages": [message], "max_tokens": 4})
        assert resp.status_code == 200, resp.text
        assert len(upstream.bodies) == sent + 1


def test_missing_model(one_engine) -> None:
    error = assert_error(
        httpx.post(router_url(one_engine) + CHAT, json={"messages": MESSAGES}), 400, "missing_model"
    )
    assert "model" in error["message"]


def test_missing_messages(one_engine) -> None:
    assert_error(httpx.post(router_url(one_engine) + CHAT, json={"model": MODEL}), 400, "missing_messages")
    assert_error(
        httpx.post(router_url(one_engine) + "/v1/completions", json={"model": MODEL}), 400, "missing_prompt"
    )
    assert_error(
        httpx.post(router_url(one_engine) + "/v1/completions", json={"model": MODEL, "prompt": [1, "a"]}),
        400,
        "invalid_type",
    )


def test_unknown_model(one_engine) -> None:
    client = openai.OpenAI(base_url=router_url(one_engine) + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=MESSAGES)  # type: ignore[arg-type]
    assert info.value.code == "model_not_found"


def test_body_over_limit_is_413(one_engine) -> None:
    upstream, router = one_engine
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}
    assert_error(httpx.post(router.url + CHAT, json=big), 413, "request_too_large")

    def chunked():  # no content-length: the limit is enforced while reading
        yield b'{"model": "test-model", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}]}'

    assert_error(httpx.post(router.url + CHAT, content=chunked(), headers=JSON), 413, "request_too_large")
    assert upstream.bodies == []


def test_upstream_4xx_passed_through(one_engine) -> None:
    upstream, router = one_engine
    upstream.fail_status = 422
    resp = httpx.post(router.url + CHAT, json={"model": MODEL, "messages": MESSAGES})
    assert resp.status_code == 422
    assert resp.json()["error"]["message"] == "e0 says no"
    assert resp.headers["x-kvroute-engine"] == "e0"


def test_upstream_timeout_is_504(one_engine) -> None:
    upstream, router = one_engine
    upstream.delay_s = 3.0
    assert_error(
        httpx.post(router.url + CHAT, json={"model": MODEL, "messages": MESSAGES}, timeout=10),
        504,
        "upstream_timeout",
    )
    text = httpx.get(router.url + "/metrics").text
    assert 'kvroute_upstream_errors_total{engine="e0",kind="timeout"} 1.0' in text
    upstream.delay_s = 0.0  # the abandoned handler ends now: the upstream server stops at once


def test_refused_twice_is_502_and_marks_unhealthy(serve_asgi) -> None:
    router = router_for(serve_asgi, [("d0", dead_url()), ("d1", dead_url())])
    error = assert_error(
        httpx.post(router.url + CHAT, json={"model": MODEL, "messages": MESSAGES}),
        502,
        "upstream_connect_error",
    )
    assert "unreachable" in error["message"]
    ready = httpx.get(router.url + "/ready")
    assert ready.status_code == 503
    assert not any(e["healthy"] for e in ready.json()["engines"].values())
    # Both are now known dead: the next request is refused by the router itself.
    assert_error(
        httpx.post(router.url + CHAT, json={"model": MODEL, "messages": MESSAGES}), 503, "no_healthy_engine"
    )


def test_retry_on_fallback_when_first_refuses(serve_asgi, upstreams) -> None:
    ((upstream, url),) = upstreams(1)
    router = router_for(serve_asgi, [("dead", dead_url()), ("e0", url)])  # round robin starts at "dead"
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]
    assert raw.headers["x-kvroute-engine"] == "e0"
    assert len(upstream.bodies) == 1
    text = httpx.get(router.url + "/metrics").text
    assert 'kvroute_upstream_errors_total{engine="dead",kind="connect"} 1.0' in text
    assert 'kvroute_engine_healthy{engine="dead"} 0.0' in text


def test_no_healthy_engine_503_from_health_polling(serve_asgi, upstreams) -> None:
    ((upstream, url),) = upstreams(1)
    upstream.health_status = 503
    router = router_for(serve_asgi, [("e0", url)], health={"interval_s": 0.05, "timeout_s": 1.0})
    deadline = time.monotonic() + 30
    while httpx.get(router.url + "/ready").status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert_error(
        httpx.post(router.url + CHAT, json={"model": MODEL, "messages": MESSAGES}), 503, "no_healthy_engine"
    )
    assert upstream.bodies == []
    upstream.health_status = 200  # recovers on the next poll
    while httpx.get(router.url + "/ready").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.post(router.url + CHAT, json={"model": MODEL, "messages": MESSAGES}).status_code == 200


def test_client_disconnect_cancels_upstream_stream(serve_asgi, upstreams) -> None:
    ((upstream, url),) = upstreams(1)
    upstream.chunks, upstream.chunk_delay_s = 2000, 0.05  # a 100 s answer: it must be cut
    router = router_for(serve_asgi, [("e0", url)])
    body = {"model": MODEL, "messages": MESSAGES, "stream": True}
    with httpx.Client(timeout=10) as client, client.stream("POST", router.url + CHAT, json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data:"):
                break  # first token seen; now hang up
    deadline = time.monotonic() + 30
    while upstream.cancelled_streams == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert upstream.cancelled_streams == 1
    text = ""
    while 'status="499"' not in text and time.monotonic() < deadline:
        text = httpx.get(router.url + "/metrics").text
        time.sleep(0.05)
    assert 'kvroute_requests_total{arm="default",engine="e0",policy="round_robin",status="499"} 1.0' in text
    assert 'kvroute_in_flight{engine="e0"} 0.0' in text
    assert len(upstream.bodies) == 1


def test_client_disconnect_cancels_non_stream_request(serve_asgi, upstreams) -> None:
    ((upstream, url),) = upstreams(1)
    upstream.delay_s = 60.0  # cancelled long before it answers
    router = router_for(serve_asgi, [("e0", url)])
    with socket.create_connection((router.host, router.port)) as sock:
        body = b'{"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}'
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        deadline = time.monotonic() + 30
        while not upstream.bodies and time.monotonic() < deadline:
            time.sleep(0.02)
        assert upstream.bodies
    deadline = time.monotonic() + 30
    text = ""
    while 'status="499"' not in text and time.monotonic() < deadline:
        text = httpx.get(router.url + "/metrics").text
        time.sleep(0.05)
    assert 'kvroute_requests_total{arm="default",engine="e0",policy="round_robin",status="499"} 1.0' in text
    assert 'kvroute_in_flight{engine="e0"} 0.0' in text
    upstream.delay_s = 0.0  # the abandoned handler ends now: the upstream server stops at once


def router_url(one_engine: tuple[Any, ThreadedServer]) -> str:
    return one_engine[1].url


def _parse_error(body: dict[str, Any]) -> str:
    """The message of the 400 ``RequestReader.parse`` raises for a chat ``body`` (no router)."""
    from router.app import RequestReader
    from router.errors import RouterError
    from router.routing import CHAT as CHAT_ENDPOINT

    config = load_config(environ={}, overrides={"engines": [{"id": "e0", "url": "http://127.0.0.1:9"}]})
    with pytest.raises(RouterError) as caught:
        RequestReader(config).parse(CHAT_ENDPOINT, json_bytes(body), {}, {}, "r1")
    assert caught.value.status == 400
    return caught.value.message


def json_bytes(body: dict[str, Any]) -> bytes:
    import json

    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        # Typed fields: the first bad one in the table's order, whatever the body's order.
        ({"user": 5, "max_tokens": "x"}, "'max_tokens' must be an integer, got str"),
        ({"stream_options": 1, "n": 1.5, "stream": "y"}, "'stream' must be a boolean, got str"),
        ({"user": ["a"], "stream_options": None}, "'user' must be a string, got list"),
        ({"max_tokens": True}, "'max_tokens' must be an integer, got bool"),
        # Ranged numbers: likewise, after the typed fields passed.
        ({"top_p": 5, "temperature": -1, "max_tokens": 0}, "'max_tokens' must be an integer >= 1, got 0"),
        ({"top_p": 5, "temperature": -1}, "'temperature' must be a number >= 0, got -1"),
        ({"temperature": 0.5, "top_p": True}, "'top_p' must be a number in (0, 1], got True"),
        ({"temperature": "hot", "max_tokens": 4}, "'temperature' must be a number >= 0, got hot"),
    ],
)
def test_the_first_bad_field_in_table_order_is_named(extra, named) -> None:
    """Only the fields a body has are checked, and when one is bad every field is checked in the
    tables' order (``_TYPED_FIELDS``, then ``_NUMBER_FIELDS``): the error names the same field
    whatever order the body lists them in."""
    body = {"model": MODEL, "messages": MESSAGES, **extra}
    assert _parse_error(body) == named
    assert _parse_error(dict(reversed(body.items()))) == named


def test_header_map_keeps_the_first_value_of_a_repeated_name_in_order() -> None:
    from router.app import header_map

    raw = [(b"host", b"a"), (b"x-session-id", b"s1"), (b"accept", b"*/*")]
    assert list(header_map(raw).items()) == [("host", "a"), ("x-session-id", "s1"), ("accept", "*/*")]
    repeated = [(b"x-session-id", b"s1"), (b"host", b"a"), (b"x-session-id", b"s2"), (b"h", b"\xe9")]
    assert list(header_map(repeated).items()) == [("x-session-id", "s1"), ("host", "a"), ("h", "\xe9")]
    assert header_map([]) == {}
