"""The router as a real ``kvroute serve`` process: slow and aborting clients (header/body timeouts,
header limits, the connection cap, quiet aborted uploads), authentication of clients and of the
introspection endpoints, and per-tenant cache isolation on a simulated engine that reports cached
tokens (issue 13 items 9, 11, 12)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from sim.server import EngineServerConfig, ThreadedEngineServer, free_port
from tests.conftest import ThreadedServer

MODEL = "test-model"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
ADMIN = "admin-token-0123456789"
KEY_A, KEY_A2, KEY_B = "sk-tenant-a-000000001", "sk-tenant-a-000000002", "sk-tenant-b-000000001"


class RouterProcess:
    """``kvroute serve --config FILE`` on a free port; stderr kept in a file for inspection."""

    def __init__(self, tmp: Path, config: dict[str, Any]) -> None:
        self.port = free_port()
        config = {"listen": {"host": "127.0.0.1", "port": self.port}, "log_level": "warning", **config}
        self.config_path = tmp / "router.json"
        self.stderr_path = tmp / "router.stderr"
        toml_lines = _to_toml(config)
        self.config_path = tmp / "router.toml"
        self.config_path.write_text(toml_lines)
        self._stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--config", str(self.config_path)],
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            env={k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")},
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"router did not start: {self.stderr()}")
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._stderr.close()


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)


def _to_toml(config: dict[str, Any]) -> str:
    lines = [f"{k} = {_toml_value(v)}" for k, v in config.items() if not isinstance(v, dict | list)]
    for key, value in config.items():
        if isinstance(value, list):
            for item in value:
                lines.append(f"[[{key}]]")
                lines.extend(f"{k} = {_toml_value(v)}" for k, v in item.items())
        elif isinstance(value, dict):
            lines.append(f"[{key}]")
            lines.extend(f"{k} = {_toml_value(v)}" for k, v in value.items())
    return "\n".join(lines) + "\n"


@pytest.fixture
def router_process(tmp_path: Path) -> Iterator[Callable[..., RouterProcess]]:
    started: list[RouterProcess] = []

    def start(**config: Any) -> RouterProcess:
        proc = RouterProcess(tmp_path, config)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


def _base(url: str, **sections: Any) -> dict[str, Any]:
    return {
        "engines": [{"id": "e0", "url": url, "model": MODEL}],
        "health": {"interval_s": 0},
        "index": {"enabled": False},
        "costs": {"scrape_interval_s": 0},
        **sections,
    }


def _recv_all(sock: socket.socket, timeout_s: float = 15.0) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


# -- item 9: slow clients ---------------------------------------------------------------------


@pytest.mark.slow
def test_slow_and_oversized_clients_are_cut_off(router_process, upstreams) -> None:
    ((upstream, url),) = upstreams(1)
    router = router_process(
        **_base(
            url,
            limits={
                "header_timeout_s": 1.0,
                "body_timeout_s": 1.0,
                "max_headers": 50,
                "max_header_bytes": 8192,
            },
        )
    )
    host, port = "127.0.0.1", router.port
    # Partial headers, never finished: answered 408 and closed (not held forever).
    with socket.create_connection((host, port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
        assert _recv_all(sock).startswith(b"HTTP/1.1 408")
    # Partial body: 408 once the body timeout passes.
    with socket.create_connection((host, port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 100\r\n\r\n{"model": '
        )
        answer = _recv_all(sock)
        assert answer.startswith(b"HTTP/1.1 408") and b"body_timeout" in answer
    # Too many header lines, too many header bytes: 431.
    many = b"".join(b"x-h%d: v\r\n" % i for i in range(80))
    with socket.create_connection((host, port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n" + many + b"\r\n")
        assert _recv_all(sock).startswith(b"HTTP/1.1 431")
    with socket.create_connection((host, port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 20000 + b"\r\n\r\n")
        assert _recv_all(sock).startswith(b"HTTP/1.1 431")
    with socket.create_connection((host, port)) as sock:  # with a body following the headers
        body = b'{"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}'
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + many
            + b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert _recv_all(sock).startswith(b"HTTP/1.1 431")
    assert upstream.bodies == []
    assert "Traceback" not in router.stderr()
    # A large body sent with its headers in one write (one read on the server) is body, not
    # header: served.
    big = json.dumps({"model": MODEL, "messages": MESSAGES, "user": "u" * 1_000_000}).encode()
    with socket.create_connection((host, port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(big), big)
        )
        assert _recv_all(sock).startswith(b"HTTP/1.1 200")
    assert httpx.get(router.url + "/health").status_code == 200


@pytest.mark.slow
def test_connection_cap_and_header_timeout_bound_an_idle_flood(router_process, upstreams) -> None:
    ((_, url),) = upstreams(1)
    router = router_process(**_base(url, limits={"max_connections": 20, "header_timeout_s": 2.0}))
    idle = [socket.create_connection(("127.0.0.1", router.port)) for _ in range(40)]
    try:
        answers = [_recv_all(sock, 10.0) for sock in idle]
        # Past the cap, connections are answered 503 and closed at once (file descriptors stay
        # free for the engines); the ones within it are cut when their headers never come.
        assert sum(a.startswith(b"HTTP/1.1 503") for a in answers) >= 15
        assert sum(a.startswith(b"HTTP/1.1 408") for a in answers) >= 15
        assert all(a.startswith((b"HTTP/1.1 503", b"HTTP/1.1 408")) for a in answers)
        assert httpx.get(router.url + "/health", timeout=5).status_code == 200
    finally:
        for sock in idle:
            sock.close()


@pytest.mark.slow
def test_aborted_uploads_are_counted_quietly(router_process, upstreams) -> None:
    ((upstream, url),) = upstreams(1)
    router = router_process(**_base(url))
    for _ in range(30):
        with socket.create_connection(("127.0.0.1", router.port)) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: 100000\r\n\r\n" + b"{" * 5000
            )
            time.sleep(0.01)
    deadline = time.monotonic() + 30
    text = ""
    while 'status="499"} 30.0' not in text and time.monotonic() < deadline:
        text = httpx.get(router.url + "/metrics").text
        time.sleep(0.1)
    assert 'kvroute_requests_total{arm="",engine="none",policy="",status="499"} 30.0' in text
    assert "Traceback" not in router.stderr()
    assert upstream.bodies == []


# -- item 11: authentication ------------------------------------------------------------------


@pytest.mark.slow
def test_production_mode_protects_introspection_and_clients_need_keys(router_process, upstreams) -> None:
    ((upstream, url),) = upstreams(1)
    router = router_process(
        **_base(
            url,
            admin={"token": ADMIN},
            auth={"production": True, "api_keys": {KEY_A: "a", KEY_B: "b"}, "max_failures_per_minute": 10},
        )
    )
    body = {"model": MODEL, "messages": MESSAGES}

    def post(path: str, token: str | None) -> httpx.Response:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return httpx.post(router.url + path, json=body, headers=headers)

    assert post("/v1/route/explain", None).status_code == 401
    assert post("/v1/route/explain", KEY_A).status_code == 403  # a client key is not the admin token
    assert post("/v1/route/explain", ADMIN).status_code == 200
    debug = httpx.get(router.url + "/debug/costs")
    assert debug.status_code == 401 and debug.json()["error"]["type"] == "authentication_error"
    assert (
        httpx.get(router.url + "/v1/experiments", headers={"authorization": f"Bearer {ADMIN}"}).status_code
        == 200
    )
    # Clients: no key, wrong key -> 401 (OpenAI-shaped, the SDK raises AuthenticationError).
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=router.url + "/v1", api_key="sk-wrong", max_retries=0).chat.completions.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
        )
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=KEY_A, max_retries=0)
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES).choices  # type: ignore[arg-type]
    assert httpx.get(router.url + "/health").status_code == 200  # probes stay open
    # Failures are rate limited per address: after the budget even the right key gets 429.
    for _ in range(10):
        post(CHAT, "sk-guess")
    limited = post(CHAT, KEY_A)
    assert limited.status_code == 429 and limited.headers["retry-after"] == "60"
    assert len(upstream.bodies) == 1


@pytest.mark.slow
def test_debug_endpoints_can_be_switched_off_or_opened_to_clients(router_process, upstreams) -> None:
    ((_, url),) = upstreams(1)
    off = router_process(**_base(url, auth={"debug_access": "off"}))
    assert httpx.get(off.url + "/debug/index").status_code == 404
    assert (
        httpx.post(off.url + "/v1/route/explain", json={"model": MODEL, "messages": MESSAGES}).status_code
        == 404
    )
    off.stop()
    keyed = router_process(**_base(url, auth={"debug_access": "api_key", "api_keys": {KEY_B: "b"}}))
    assert httpx.get(keyed.url + "/debug/costs").status_code == 401
    assert (
        httpx.get(keyed.url + "/debug/costs", headers={"authorization": f"Bearer {KEY_B}"}).status_code == 200
    )


# -- item 12: tenants never share cached blocks ----------------------------------------------


@pytest.fixture
def sim_engine() -> Iterator[ThreadedEngineServer]:
    cfg = EngineServerConfig(
        port=free_port(), engine_id="s0", model=MODEL, gpu_blocks=4096, time_scale=1000.0
    )
    with ThreadedEngineServer(cfg) as server:
        yield server


def _cached_tokens(client: openai.OpenAI, messages: list[dict[str, str]], **extra: Any) -> int:
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=extra)  # type: ignore[arg-type]
    details = reply.usage.prompt_tokens_details if reply.usage else None
    return int(details.cached_tokens or 0) if details else 0


@pytest.mark.slow
def test_tenants_do_not_share_cached_prefixes(router_process, sim_engine) -> None:
    router = router_process(**_base(sim_engine.url, auth={"api_keys": {KEY_A: "a", KEY_A2: "a", KEY_B: "b"}}))
    prompt = [{"role": "user", "content": "A long shared system prompt about kv caches. " * 40}]

    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0)

    assert _cached_tokens(client(KEY_A), prompt) == 0
    assert _cached_tokens(client(KEY_A), prompt) > 100  # same tenant: the engine reuses the prefix
    assert _cached_tokens(client(KEY_A2), prompt) > 100  # another key of the same tenant shares
    assert _cached_tokens(client(KEY_B), prompt) == 0  # another tenant never does
    # Nor by sending what it guesses the other tenant's salt is: its own salt always comes first.
    salt_a = "t-" + __import__("hashlib").sha256(b"a").hexdigest()[:32]
    assert _cached_tokens(client(KEY_B), prompt, cache_salt=salt_a) == 0


def test_tenant_from_a_trusted_header(serve_asgi: Callable[..., ThreadedServer], sim_engine) -> None:
    from router.config import load_config
    from router.service import build_router_app

    config = load_config(environ={}, overrides=_base(sim_engine.url, tenancy={"source": "header"}))
    router = serve_asgi(build_router_app(config))
    prompt = [{"role": "user", "content": "Another long prompt for header tenants. " * 40}]

    def client(tenant: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=router.url + "/v1", api_key="x", max_retries=0, default_headers={"x-tenant-id": tenant}
        )

    assert _cached_tokens(client("t1"), prompt) == 0
    assert _cached_tokens(client("t1"), prompt) > 100
    assert _cached_tokens(client("t2"), prompt) == 0
