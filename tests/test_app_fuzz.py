"""Schemathesis against the router's own OpenAPI document (/openapi.json): generated valid and
invalid requests to every operation of the fully wired router in front of a live stand-in engine;
no request may get a 5xx (issue 13 item 6). Bounded: KVROUTE_FUZZ_EXAMPLES per operation and mode
(default 15); KVROUTE_FUZZ_REPORT=path appends one "METHOD path status" line per request (the
fault benchmark counts them)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from router.config import load_config
from router.service import build_router_app
from tests.conftest import OpenAIUpstream, ThreadedServer

MODEL = "test-model"
EXAMPLES = int(os.environ.get("KVROUTE_FUZZ_EXAMPLES", "15"))
REPORT = os.environ.get("KVROUTE_FUZZ_REPORT", "")


def _config(engine_url: str) -> Any:
    return load_config(
        environ={},
        overrides={
            "engines": [{"id": "e0", "url": engine_url}],  # serves any model: bodies reach it
            "health": {"interval_s": 0},
            "index": {"enabled": False},
            "costs": {"scrape_interval_s": 0},
            "tokenizer": {"backend": "sim"},
            "limits": {"max_body_bytes": 65536, "read_timeout_s": 5.0},
            "admin": {"token": "fuzz-admin-token-0123"},
        },
    )


# The schema is the router's own, read from a built (not started) app: no server at import time.
schema = schemathesis.openapi.from_dict(build_router_app(_config("http://127.0.0.1:9")).openapi())


@pytest.fixture(scope="module")
def router_url() -> Iterator[str]:
    upstream = OpenAIUpstream("e0", model=MODEL)
    engine = ThreadedServer(upstream.app()).start()
    router = ThreadedServer(build_router_app(_config(engine.url))).start()
    try:
        yield router.url
    finally:
        router.stop()
        engine.stop()


@pytest.mark.slow
def test_the_schema_documents_the_request_bodies(router_url: str) -> None:
    served = httpx.get(router_url + "/openapi.json").json()
    chat = served["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["required"] == ["model", "messages"]
    assert "/v1/route/explain" in served["paths"]


@pytest.mark.slow
@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_no_generated_request_gets_a_server_error(case: schemathesis.Case, router_url: str) -> None:
    response = case.call(base_url=router_url, timeout=30)
    if REPORT:
        with open(REPORT, "a") as fh:
            fh.write(f"{case.method} {case.path} {response.status_code} {response.text[:150]!r}\n")
    assert response.status_code < 500, (
        f"{case.method} {case.formatted_path}: {response.status_code} {response.text[:300]}"
    )
