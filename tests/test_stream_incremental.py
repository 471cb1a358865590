"""A stream is relayed as it is produced: every event reaches the client while the engine is still
writing the next ones (a relay that holds the events back until the end, or until some buffer
fills, breaks streaming for every client and hides a mid-stream crash behind a finished answer)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from router.app import create_app
from router.config import load_config
from tests.conftest import OpenAIUpstream, ThreadedServer

MODEL = "test-model"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_events_reach_the_client_while_the_engine_writes(
    serve_asgi: Callable[..., ThreadedServer], upstreams: Any, path: str
) -> None:
    engines = upstreams(1)
    upstream: OpenAIUpstream = engines[0][0]
    upstream.chunks, upstream.chunk_delay_s = 40, 0.05  # a 2 s answer
    config = load_config(
        environ={},
        overrides={
            "engines": [{"id": u.name, "url": url, "model": MODEL} for u, url in engines],
            "health": {"interval_s": 0},
        },
    )
    server = serve_asgi(create_app(config))
    body: dict[str, Any] = {"model": MODEL, "stream": True, "max_tokens": 40}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hello"}]
    else:
        body["prompt"] = "hello"
    arrivals: list[float] = []
    with httpx.stream("POST", server.url + path, json=body, timeout=30) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                arrivals.append(time.monotonic())
    assert len(arrivals) >= 40
    # The engine spends ~2 s writing; events relayed as they come are spread over that time. A
    # held-back stream delivers (nearly) all of them at the end, within a few milliseconds.
    spread = arrivals[-1] - arrivals[len(arrivals) // 4]
    assert spread > 0.5, (
        f"events arrived in a burst ({spread * 1000:.0f} ms from the first quarter to the end)"
    )
