"""kvroute in front of real vLLM engines (the CPU build, a tiny dummy-weight Llama): the index's
predictions against what the engine reports, replay after a router restart, block-size detection,
priorities, tokenizer parity, an engine killed mid-stream, and a CPU tier and a shared STORAGE
pool (vLLM's own offloading with sim/vllm_host_offload.py's worker). Skipped by ``make test``; run by
``make test-vllm`` (tests/vllm/conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loadtest.calib_compare import cpu_seconds
from loadtest.procs import wait_sources_connected
from router.tokenize import EngineChatTokenizer, HfChatTokenizer
from sim.vllm_cpu import VllmCpuFleet
from sim.vllm_model import MODEL_NAME, training_text, write_model_dir
from tests.conftest import ThreadedServer
from tests.test_priority import _escalations
from tests.vllm.conftest import PROFILE, metric_total, scheduled_ahead_of_other_sessions, until

# The first test also waits for the session fleet to start (minutes: the first start compiles).
pytestmark = pytest.mark.timeout(2700)


def _words(n: int, seed: int) -> str:
    """About ``n`` words of the tokenizer's own kind of text (distinct per seed)."""
    lines = training_text(num_lines=400, seed=seed)
    text = " ".join(lines)
    return f"[{seed}] " + " ".join(text.split()[:n])


def _client(url: str, session: str = "") -> openai.OpenAI:
    headers = {"x-session-id": session} if session else {}
    return openai.OpenAI(
        base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=300, default_headers=headers
    )


def _explain(url: str, messages: list[dict[str, str]], session: str) -> dict[str, Any]:
    resp = httpx.post(
        f"{url}/v1/route/explain",
        json={"model": MODEL_NAME, "messages": messages, "max_tokens": 8},
        headers={"x-session-id": session},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def _prefix_tokens(explain: dict[str, Any]) -> dict[str, int]:
    return {e["engine_id"]: e["prefix_tokens"] for e in explain["engines"]}


def _barrier(url: str, engine_url: str, engine_id: str, tag: str) -> None:
    """Wait until the router's index holds every KV event the engine published so far: send the
    engine a fresh two-block prompt directly, and wait until the router's explain sees it cached
    there (one engine publishes its batches in order on one socket)."""
    messages = [{"role": "user", "content": _words(90, seed=zlib.crc32(tag.encode()) % 100_000)}]
    httpx.post(
        f"{engine_url}/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": messages, "max_tokens": 1},
        timeout=300,
    ).raise_for_status()
    deadline = time.monotonic() + 60
    while _prefix_tokens(_explain(url, messages, "barrier"))[engine_id] < PROFILE.block_size:
        assert time.monotonic() < deadline, f"the router never saw the barrier {tag} on {engine_id}"
        time.sleep(0.05)


class Conversation:
    def __init__(self, url: str, seed: int) -> None:
        self.url, self.session = url, f"conv-{seed}"
        self.client = _client(url, self.session)
        self.seed = seed
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": _words(300, seed=seed)},
            {"role": "user", "content": _words(250, seed=seed + 1000)},
        ]

    def turn(self, k: int) -> tuple[str, int, int, int]:
        """(engine, explain's predicted prefix tokens there, engine's cached tokens, prompt tokens)."""
        predicted = _prefix_tokens(_explain(self.url, self.messages, self.session))
        raw = self.client.chat.completions.with_raw_response.create(
            model=MODEL_NAME,
            messages=self.messages,  # type: ignore[arg-type]
            max_tokens=24,
            temperature=0.0,
        )
        engine = raw.headers["x-kvroute-engine"]
        reply = raw.parse()
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        cached = reply.usage.prompt_tokens_details.cached_tokens or 0
        self.messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        self.messages.append({"role": "user", "content": _words(250, seed=self.seed * 10 + k)})
        return engine, predicted[engine], cached, reply.usage.prompt_tokens


def test_explain_predicts_the_engines_cached_tokens_turn_by_turn_also_after_eviction(
    vllm_fleet: VllmCpuFleet, start_router: Callable[..., ThreadedServer]
) -> None:
    router = start_router()
    urls = {e.id: e.url for e in vllm_fleet.engines}
    conversations = [Conversation(router.url, seed) for seed in range(8)]
    rows = []
    for k in range(5):
        for conv in conversations:
            engine, predicted, cached, prompt = conv.turn(k)
            rows.append((conv.seed, k, engine, predicted, cached, prompt))
            _barrier(router.url, urls[engine], engine, f"{conv.seed}-{k}")
    table = "\n".join(str(r) for r in rows)
    assert all(predicted == cached for *_, predicted, cached, _prompt in rows), table
    assert sum(cached for *_, cached, _ in rows) > 0, table  # history was found at all
    # Eviction happened: some turn found less than the previous turn's prompt of its conversation.
    by_conv: dict[int, list[tuple[int, int, int]]] = {}
    for seed, _k, _engine, _predicted, cached, prompt in rows:
        by_conv.setdefault(seed, []).append((cached, prompt, _k))
    evicted = [
        (seed, turns[i][2])
        for seed, turns in by_conv.items()
        for i in range(1, len(turns))
        if turns[i][0] < (turns[i - 1][1] // PROFILE.block_size) * PROFILE.block_size
    ]
    assert evicted, table
    # The engines' prompt counts agree with the router's tokenizer (no parity warning).
    ready = httpx.get(f"{router.url}/ready", timeout=10).json()["events"]
    assert ready["prompt_token_mismatch"] == {}


def test_a_restarted_router_rebuilds_the_index_exactly_from_replay(
    vllm_fleet: VllmCpuFleet, start_router: Callable[..., ThreadedServer]
) -> None:
    first = start_router()
    conversations = [Conversation(first.url, seed) for seed in (100, 101, 102)]
    for k in range(2):
        for conv in conversations:
            conv.turn(k)
    for e in vllm_fleet.engines:
        _barrier(first.url, e.url, e.id, f"restart-{e.id}")
    probes = [conv.messages for conv in conversations]
    before = [_prefix_tokens(_explain(first.url, m, "probe")) for m in probes]
    index_before = httpx.get(f"{first.url}/debug/index", timeout=10).json()["index"]
    first.stop()

    second = start_router()

    def replayed() -> bool:
        sources = httpx.get(f"{second.url}/debug/index", timeout=10).json()["events"]["sources"]
        return all(s["replays"] >= 1 and s["status"] != "stale" for s in sources.values())

    deadline = time.monotonic() + 60
    while not replayed():
        assert time.monotonic() < deadline, "the new router did not replay every engine's buffer"
        time.sleep(0.1)
    after = [_prefix_tokens(_explain(second.url, m, "probe")) for m in probes]
    assert after == before
    assert any(v > 0 for row in after for v in row.values())
    assert httpx.get(f"{second.url}/debug/index", timeout=10).json()["index"] == index_before


def test_block_size_is_detected_from_the_engines_metrics(
    vllm_fleet: VllmCpuFleet, model_dir: Path, serve_asgi: Callable[..., ThreadedServer]
) -> None:
    from router.config import load_config
    from router.service import build_router_app

    data = {
        "engines": vllm_fleet.fleet_entries(block_size=16),  # wrong on purpose: the engines use 32
        "tokenizer": {"backend": "hf", "path": str(model_dir)},
        "policy": {"name": "tier_cost"},
        "costs": {"scrape_interval_s": 0.2},
        "log_level": "error",
    }
    router = serve_asgi(build_router_app(load_config(environ={}, overrides=data)))
    deadline = time.monotonic() + 60
    while True:
        mismatch = (
            httpx.get(f"{router.url}/ready", timeout=10).json()["events"].get("block_size_mismatch", {})
        )
        if len(mismatch) == len(vllm_fleet.engines):
            break
        assert time.monotonic() < deadline, f"block size not detected: {mismatch}"
        time.sleep(0.1)
    assert all("block_size 32" in text and "says 16" in text for text in mismatch.values())
    explain = _explain(router.url, [{"role": "user", "content": _words(100, 7)}], "bs")
    assert explain["block_size"] == 32


def _engine_tokens(engine_url: str, messages: list[dict[str, str]]) -> list[int]:
    resp = httpx.post(
        f"{engine_url}/tokenize",
        json={"model": MODEL_NAME, "messages": messages, "add_generation_prompt": True},
        timeout=60,
    )
    resp.raise_for_status()
    tokens: list[int] = resp.json()["tokens"]
    return tokens


def _chats() -> list[list[dict[str, str]]]:
    out = []
    for seed in range(4):
        msgs = [{"role": "system", "content": _words(50, seed)}]
        for k in range(seed + 1):
            msgs.append({"role": "user", "content": _words(80 + 40 * k, seed * 7 + k) + " éü 中文 🙂"})
            msgs.append({"role": "assistant", "content": _words(30, seed * 11 + k)})
        out.append(msgs[:-1])
    return out


async def test_tokenizer_parity_hf_and_engine_backends(
    vllm_fleet: VllmCpuFleet, model_dir: Path, tmp_path: Path
) -> None:
    """The router's token ids equal the engine's, with the hf back-end (also from a tokenizer.json
    that stores truncation and padding, which vLLM ignores) and the engine back-end."""
    import aiohttp

    engine = vllm_fleet.engines[0]
    stored = tmp_path / "stored"
    stored.mkdir()
    for name in ("tokenizer_config.json", "config.json"):
        (stored / name).write_text((model_dir / name).read_text())
    doc = json.loads((model_dir / "tokenizer.json").read_text())
    doc["truncation"] = {"direction": "Right", "max_length": 128, "strategy": "LongestFirst", "stride": 0}
    doc["padding"] = {
        "strategy": {"Fixed": 160}, "direction": "Right", "pad_to_multiple_of": None,
        "pad_id": 5, "pad_type_id": 0, "pad_token": "<|pad|>",
    }  # fmt: skip
    (stored / "tokenizer.json").write_text(json.dumps(doc))
    hf = HfChatTokenizer.from_dir(model_dir)
    hf_stored = HfChatTokenizer.from_dir(stored)
    async with aiohttp.ClientSession() as session:
        via_engine = EngineChatTokenizer(session, engine.url, model=MODEL_NAME)
        for msgs in _chats():
            expected = _engine_tokens(engine.url, msgs)
            assert len(expected) > 160
            assert await hf.chat_tokens(msgs) == expected
            assert await hf_stored.chat_tokens(msgs) == expected
            assert await via_engine.chat_tokens(msgs) == expected
    # vLLM's own tokenizer loading ignores the stored truncation and padding too.
    assert vllm_fleet.python is not None
    code = (
        "import json, sys\n"
        "from vllm.tokenizers import get_tokenizer\n"
        "tok = get_tokenizer(sys.argv[1])\n"
        "ids = tok.apply_chat_template(json.loads(sys.argv[2]), add_generation_prompt=True, tokenize=True)\n"
        "ids = ids['input_ids'] if hasattr(ids, 'keys') else ids\n"  # transformers 5: a BatchEncoding
        "print(json.dumps(list(ids)))\n"
    )
    msgs = _chats()[2]
    proc = await asyncio.to_thread(
        subprocess.run,
        [str(vllm_fleet.python), "-c", code, str(stored), json.dumps(msgs)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == _engine_tokens(engine.url, msgs)


def test_a_foreign_tokenizer_is_caught_by_the_live_parity_check(
    vllm_fleet: VllmCpuFleet, start_router: Callable[..., ThreadedServer], tmp_path: Path
) -> None:
    # Barely more than the byte alphabet: about three times the engines' token counts.
    foreign = write_model_dir(tmp_path / "foreign", vocab_size=300)
    # round_robin: 5 requests on each engine (a cache-aware policy may send 7 of 10 to one engine,
    # leaving the other short of the 4-of-8 evidence the check asks for).
    router = start_router(policy={"name": "round_robin"}, tokenizer={"backend": "hf", "path": str(foreign)})
    client = _client(router.url)
    for seed in range(10):
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": _words(60 + 10 * seed, seed)}],
            max_tokens=2,
        )
    ready = httpx.get(f"{router.url}/ready", timeout=10).json()["events"]
    assert set(ready["prompt_token_mismatch"]) == {e.id for e in vllm_fleet.engines}
    assert all("tokens per router token" in why for why in ready["prompt_token_mismatch"].values())
    metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
    assert 'kvroute_prompt_token_mismatch{engine="v0"} 1.0' in metrics


def test_router_set_priorities_are_accepted_by_a_priority_engine(
    vllm_fleet: VllmCpuFleet, start_router: Callable[..., ThreadedServer]
) -> None:
    router = start_router(policy={"name": "round_robin"})
    client = _client(router.url)
    for seed in range(6):
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": _words(40, seed)}], max_tokens=2
        )
    metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
    sent = [
        line
        for line in metrics.splitlines()
        if line.startswith("kvroute_priority_requests_total{") and not line.endswith(" 0.0")
    ]
    assert sent and all('engine="v1"' in line for line in sent), sent  # only the priority engine
    ok = [line for line in metrics.splitlines() if line.startswith("kvroute_requests_total{")]
    assert not [line for line in ok if 'status="5' in line or 'status="4' in line], ok


def test_what_an_fcfs_engine_does_with_a_priority(vllm_fleet: VllmCpuFleet) -> None:
    """vLLM 0.32 with --scheduling-policy fcfs accepts a request that carries a priority and
    ignores it: its protocol text promises an error, but neither the API server nor the engine
    checks (the FCFS queue appends and pops in arrival order; preemption takes the last running)."""
    fcfs = next(e for e in vllm_fleet.engines if e.scheduling_policy == "fcfs")
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    for priority in (0, 3, -7):
        resp = httpx.post(f"{fcfs.url}/v1/chat/completions", json={**body, "priority": priority}, timeout=120)
        assert resp.status_code == 200, (priority, resp.text)
        assert resp.json()["usage"]["completion_tokens"] == 2


def _events_seen(router_url: str, source: str) -> int:
    """KV events the router has received from ``source`` (the engine core publishes them itself)."""
    sources = httpx.get(f"{router_url}/debug/index", timeout=10).json()["events"]["sources"]
    return int(sources[source]["events"])


def _engine_core_pids(engine: Any) -> list[int]:
    """The processes of an engine's process group other than its API server: vLLM's engine core
    (and whatever it spawned). The fleet starts each engine in a session of its own, so the group
    id is the API server's pid."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        pid = int(stat.parent.name)
        if int(fields[2]) == engine.pid and pid != engine.pid:  # fields after ")": state, ppid, pgrp
            pids.append(pid)
    return pids


def _cpu_s(pids: list[int]) -> float:
    """The CPU time (user + system, s) the processes ``pids`` have used so far."""
    return sum(cpu_seconds(pid) for pid in pids)


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # a helper process that has exited
            os.kill(pid, sig)


def test_an_engine_killed_mid_stream_raises_in_the_openai_sdk(
    vllm_fleet: VllmCpuFleet, serve_asgi: Callable[..., ThreadedServer], tmp_path: Path
) -> None:
    """A third engine of its own (the session's two stay up): SIGKILL to its process group while a
    stream runs through the router; the client's iteration must raise, not end quietly.

    The kill must come while the engine is still generating, and on two busy cores nothing the
    engine publishes says when that is: vLLM's CPU API server can hold a stream's events until the
    answer is complete (a direct client, nothing else running, got 2 of 4 1,000-token streams in one
    burst at the end), and its KV events can come in one burst too (CI, stop 34: the router went
    from under 7 answer blocks to all 235 between two polls 50 ms apart). So the test rations the
    engine core's CPU itself: the core (every process of the engine but its API server) is stopped
    before the request is sent, then let run 0.1 s at a time, each slice followed by up to 2 s
    stopped for the API server and the router to pass on what it made. The first slice after which
    the client holds some of the answer ends it: SIGKILL to the whole group, with the engine core
    never having run more than the slices.

    The rationing thread is not always woken on time: on a quiet machine its 0.1 s sleeps overran
    by up to 1 s while vLLM decoded (~550 tokens/s), beside two busy loops one overran by 54 s, and
    in CI (stop 51) an engine core let run for one slice decoded the whole of a 7,500-token answer
    before it was stopped again. Hence two guards: the test's session is put ahead of the engines'
    while it rations (where the kernel allows, see ``scheduled_ahead_of_other_sessions``), and the
    answer asked for is long (60,000 tokens: the engine has a model folder of its own with a
    65,536-token context)."""
    from router.config import load_config
    from router.service import build_router_app

    max_tokens, context = 60_000, 65_536  # with the ~100-token prompt, within the context
    answer_blocks = max_tokens // PROFILE.block_size
    slice_s, max_slices = 0.1, 60
    model_dir = write_model_dir(tmp_path / "model", max_position_embeddings=context)
    own = VllmCpuFleet(tmp_path, model_dir=model_dir)
    profile = replace(
        PROFILE,
        enforce_eager=True,  # no compilation: this extra engine starts in about a minute
        max_model_len=context,
        gpu_blocks=context // PROFILE.block_size + 2,  # one request of the context, and vLLM's null block
    )
    core: list[int] = []
    try:
        (engine,) = own.start_each([profile], id_prefix="k")
        data = {
            "engines": own.fleet_entries(),
            "tokenizer": {"backend": "hf", "path": str(model_dir)},
            "policy": {"name": "tier_cost"},
            # The rationed engine may take longer than the default 30 s first-byte budget to send
            # its first token (60 slices of up to ~2.1 s; a busy machine, 2026-12-05): not this
            # test's subject.
            "limits": {"first_byte_timeout_s": 300.0},
            "log_level": "error",
        }
        router = serve_asgi(build_router_app(load_config(environ={}, overrides=data)))
        wait_sources_connected(router.url)
        source = f"{engine.id}/dp0"
        outcome: dict[str, Any] = {"chunks": 0}

        def consume() -> None:
            try:
                stream = _client(router.url).chat.completions.create(
                    model=MODEL_NAME,
                    messages=[{"role": "user", "content": _words(50, 3)}],
                    max_tokens=max_tokens,
                    stream=True,
                    extra_body={"ignore_eos": True, "min_tokens": max_tokens},
                )
                outcome["open"] = True  # the answer's headers reached the client
                for _chunk in stream:
                    outcome["chunks"] += 1
                outcome["clean_end"] = True
            except openai.APIError as exc:
                outcome["error"] = exc

        core = _engine_core_pids(engine)
        assert core, "the engine has no engine-core process to stop"
        before = _events_seen(router.url, source)
        with scheduled_ahead_of_other_sessions() as ahead:
            _signal_all(core, signal.SIGSTOP)
            cpu_before = _cpu_s(core)  # what the slices gave the core, for the messages
            client = threading.Thread(target=consume, name="stream-client", daemon=True)
            client.start()
            slices = 0
            slice_lengths: list[float] = []
            while not outcome["chunks"]:
                used = f"{slices} slices, {_cpu_s(core) - cpu_before:.1f} s of the engine core's CPU"
                assert client.is_alive(), f"the stream ended while rationed ({used}): {outcome}"
                assert slices < max_slices, f"no chunk reached the client after {used}: {outcome}"
                started = time.monotonic()
                _signal_all(core, signal.SIGCONT)
                time.sleep(slice_s)  # the engine core's ration of CPU, not a wait for a condition
                _signal_all(core, signal.SIGSTOP)
                slice_lengths.append(time.monotonic() - started)
                slices += 1
                drained = time.monotonic() + 2
                while not outcome["chunks"] and time.monotonic() < drained:
                    time.sleep(0.02)
            chunks_at_kill = outcome["chunks"]
            # The engine's progress as published while it ran; it cannot grow any more.
            events_at_kill = _events_seen(router.url, source) - before
            print(
                f"engine core ran {slices} slices of {slice_s} s ({_cpu_s(core) - cpu_before:.1f} s CPU): "
                f"{events_at_kill} KV events, {chunks_at_kill} chunks at the kill; "
                f"slices lasted {[round(x, 3) for x in slice_lengths]} s "
                f"({'ahead of' if ahead else 'at par with'} the engine's CPU share)"
            )
            assert events_at_kill < answer_blocks, (
                f"the engine decoded the whole answer ({events_at_kill} blocks) "
                f"in {slices} slices of {slice_s} s"
            )
            own.stop_engine(engine, signal.SIGKILL)
        client.join(timeout=120)
        assert not client.is_alive(), "the client still waits two minutes after the engine died"
        assert "clean_end" not in outcome, (
            f"the stream ended as a complete answer after the engine was killed "
            f"({outcome['chunks']} chunks; {events_at_kill} KV events of the answer at the kill)"
        )
        assert isinstance(outcome.get("error"), openai.APIError), outcome
        assert 0 < outcome["chunks"] < max_tokens
    finally:
        _signal_all(core, signal.SIGCONT)  # a stopped process would hold its SIGTERM
        own.stop()


def test_vllm_router_kv_aware_follows_the_engines_kv_events(
    vllm_fleet: VllmCpuFleet, start_router: Callable[..., ThreadedServer], tmp_path: Path
) -> None:
    """vllm-router's kv_aware policy on real engines: it reads their ZMQ events and recomputes vLLM's
    sha256_cbor block hashes from ``/v1/chat/completions/render`` (served with --enable-scale-out).
    Four conversations, one request at a time (equal load: only the KV decides): every later turn
    must land where its history is cached. Blind routing (events unread, hashes not matching) would
    send about half of them to the other engine, which reports no cached tokens.

    Between turns the test waits until the engines' events of the turn are out: a kvroute router
    subscribed to the same sockets holds a barrier prompt sent to each engine after the turn (an
    engine publishes its batches in order on one socket, and both subscribers read it on loopback)."""
    from loadtest.bench_peers import default_peers_dir, install_peer, peer_command, wait_routes
    from loadtest.load import stop_process
    from sim.server import free_port

    peers_dir = default_peers_dir()
    try:
        binary = install_peer(peers_dir, "vllm-router")
    except RuntimeError as exc:
        pytest.skip(f"vllm-router cannot be installed here: {exc}")
    engines = vllm_fleet.engines
    extra = ["--kv-event-block-size", str(PROFILE.block_size), "--kv-event-model", MODEL_NAME]
    for e in engines:
        extra += ["--kv-event-source", f"{e.url}={e.kv_events_endpoint}"]
    port = free_port()
    with open(tmp_path / "vllm-router.log", "wb") as log:
        proc = subprocess.Popen(
            peer_command(binary, "vllm-router", "kv_aware", port, engines, extra),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        watcher = start_router()
        url = f"http://127.0.0.1:{port}"
        wait_routes(url, proc, model=MODEL_NAME)
        later: list[tuple[int, int]] = []
        for seed in range(4):
            client = _client(url)
            messages = [{"role": "user", "content": _words(300, seed=5000 + seed)}]
            previous = 0
            for k in range(3):
                reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8)  # type: ignore[arg-type]
                assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
                if k:
                    later.append((reply.usage.prompt_tokens_details.cached_tokens or 0, previous))
                previous = reply.usage.prompt_tokens
                messages += [
                    {"role": "assistant", "content": reply.choices[0].message.content or ""},
                    {"role": "user", "content": _words(120, seed=6000 + 10 * seed + k)},
                ]
                for e in engines:
                    _barrier(watcher.url, e.url, e.id, f"kv-aware-{seed}-{k}")
        # every later turn finds (nearly) its whole previous prompt cached: the blocks it filled
        missed = [(c, p) for c, p in later if c < (p // PROFILE.block_size - 1) * PROFILE.block_size]
        assert not missed, (
            f"(cached, previous prompt) of later turns routed away from their history: {missed}"
        )
    finally:
        stop_process(proc)


def _in_flight(router_url: str) -> float:
    """The router's kvroute_in_flight gauge, summed over engines."""
    return metric_total(router_url, "kvroute_in_flight")


def _until(what: str, check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    assert until(check, timeout_s), f"not within {timeout_s:g} s: {what}"


#: Output tokens of A: ~1 s of decode here, while the engine core reads long and short in.
A_TOKENS = 300
#: Output tokens of long and short.
DECODE = 4


def test_escalation_reverses_a_one_slot_priority_engines_order(
    model_dir: Path, serve_asgi: Callable[..., ThreadedServer], tmp_path: Path
) -> None:
    """The live router's escalation (costs.priority_escalate_after_s) against vLLM itself.

    One engine of its own, --scheduling-policy priority, --max-num-seqs 1, its engine core stopped
    (SIGSTOP). A (A_TOKENS tokens, with a client priority ahead of any the router sets), long
    (~1,500 tokens of prompt) and short (~80), each decoding DECODE tokens, are sent through the
    router, streamed; then the core is let run. Without escalation it serves A, then short (the
    router's shortest-work priorities), then long. With escalation after 2 s long and short are
    cancelled and sent again at priority 0, served first come: long first. The router counts two
    escalations; every answer is whole.

    The order is read from the engine's own report: long's text begins with short's, so the one
    served second finds the other's first block in vLLM's prefix cache (its usage's
    cached_tokens), the first none. When each answer reaches the client says nothing here: vLLM's
    CPU API server can pass both on in one burst. That vLLM drops the cancelled attempts from its
    queue at once was measured apart (docs/results/q25/abort_check.py); with the core stopped the
    aborts and the re-sends reach it together."""
    from router.config import load_config
    from router.service import build_router_app

    own = VllmCpuFleet(tmp_path, model_dir=model_dir)
    core: list[int] = []
    try:
        profile = replace(
            PROFILE, enforce_eager=True, scheduling_policy="priority", extra_args=("--max-num-seqs", "1")
        )
        (engine,) = own.start_each([profile], id_prefix="p")
        core = _engine_core_pids(engine)
        assert core, "the engine has no engine-core process to stop"

        def run(escalate_after_s: float, seed: int) -> dict[str, int]:
            data = {
                "engines": own.fleet_entries(),
                "tokenizer": {"backend": "hf", "path": str(model_dir)},
                "policy": {"name": "tier_cost"},
                "costs": {"scrape_interval_s": 0, "priority_escalate_after_s": escalate_after_s},
                # A busy machine slows the one-slot engine a lot: no fail-over for a slow first byte.
                "limits": {"first_byte_timeout_s": 600},
                "log_level": "warning",
            }
            router = serve_asgi(build_router_app(load_config(environ={}, overrides=data)))
            wait_sources_connected(router.url)
            tokens: dict[str, int] = {}
            cached: dict[str, int] = {}  # the engine's cached prompt tokens, by request
            errors: list[BaseException] = []

            def send(name: str, words: int, max_tokens: int, extra: dict[str, Any]) -> None:
                try:
                    stream = _client(router.url).chat.completions.create(
                        model=MODEL_NAME,
                        # long's text begins with short's: the one served second finds the other's
                        # first blocks in the prefix cache (A's text is its own).
                        messages=[{"role": "user", "content": _words(words, seed + (name == "a"))}],
                        max_tokens=max_tokens,
                        stream=True,
                        stream_options={"include_usage": True},
                        extra_body={"ignore_eos": True, "min_tokens": max_tokens, **extra},
                    )
                    for chunk in stream:
                        if chunk.usage is not None:
                            tokens[name] = chunk.usage.completion_tokens
                            details = chunk.usage.prompt_tokens_details
                            cached[name] = (details.cached_tokens or 0) if details is not None else -1
                except Exception as exc:  # reported by the assertions below
                    errors.append(exc)

            # The engine core is stopped first: on two busy cores nothing else makes "A still
            # runs while the others queue" hold (vLLM's CPU API server can hold A's first chunk,
            # and its gauges, until A has ended). A carries a priority of its own, ahead of any
            # the router sets, so the engine core, let run again, serves A first, whatever order
            # it reads the three in; the others then queue behind A's decode.
            _signal_all(core, signal.SIGSTOP)
            threads: list[threading.Thread] = []
            try:
                for name, words, max_tokens, extra in (
                    ("a", 30, A_TOKENS, {"priority": -1000}),
                    ("long", 1200, DECODE, {}),
                    ("short", 60, DECODE, {}),
                ):
                    threads.append(
                        threading.Thread(target=send, args=(name, words, max_tokens, extra), daemon=True)
                    )
                    threads[-1].start()
                    sent = len(threads)
                    _until(f"{name} sent", lambda n=sent: _in_flight(router.url) >= n or bool(errors))
                if escalate_after_s:
                    _until("two escalations", lambda: _escalations(router.url) >= 2 or bool(errors))
            finally:
                _signal_all(core, signal.SIGCONT)
            for thread in threads:
                thread.join(timeout=120)
            assert not errors, errors
            assert tokens == {"a": A_TOKENS, "long": DECODE, "short": DECODE}, tokens
            assert _escalations(router.url) == (2 if escalate_after_s else 0)
            router.stop()
            return cached

        block = PROFILE.block_size
        plain = run(0.0, 100)  # short served first: long finds short's blocks
        assert plain["short"] == 0 and plain["long"] >= block, plain
        escalated = run(2.0, 200)  # long served first: short finds long's
        assert escalated["long"] == 0 and escalated["short"] >= block, escalated
    finally:
        _signal_all(core, signal.SIGCONT)  # a stopped process would hold its SIGTERM
        own.stop()


def test_the_engines_phase_histograms_read_as_one_runs_percentiles(vllm_fleet: VllmCpuFleet) -> None:
    """bench_quality_live's phases (round q37) from a real engine's /metrics, checked against the
    client: a delta counts exactly the requests sent between two scrapes, and the engine's own TTFT
    (from its arrival, after the API server tokenized the prompt) is never longer than the client's
    for the same requests. Catches a histogram read under the wrong name, summed over the wrong
    samples, or not as the difference of the two scrapes."""
    from loadtest.bench_quality_live import phase_percentiles, scrape_engines

    engines = vllm_fleet.engines[:1]
    before = scrape_engines(engines)
    client = _client(engines[0].url)
    worst = 0.0
    for seed in range(5):
        t0 = time.monotonic()
        stream = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": _words(300, 9100 + seed)}],
            max_tokens=4,
            stream=True,
        )
        first = None
        for _chunk in stream:
            first = first or time.monotonic() - t0
        assert first is not None
        worst = max(worst, first)
    after = scrape_engines(engines)
    phases = phase_percentiles(before, after)
    assert set(phases) == {"engine_ttft", "queue", "prefill"}, phases
    assert [p[2] for p in phases.values()] == [5.0, 5.0, 5.0], phases
    assert all(0 <= p50 <= p99 for p50, p99, _ in phases.values()), phases
    # Every engine TTFT is at most the client's worst, so its percentiles (interpolated within
    # vLLM's buckets) are at most the upper bound of the bucket that holds the client's worst.
    bound = min(le for le in after.phases["engine_ttft"] if le >= worst)
    assert 0 < phases["engine_ttft"][0] <= phases["engine_ttft"][1] <= bound, (phases, worst)


def test_the_engines_temp_files_stay_in_the_fleets_own_folder(vllm_fleet: VllmCpuFleet) -> None:
    """vLLM puts its ZMQ IPC sockets and ``vllm_dist_*`` files where ``tempfile`` points and leaves
    them there after shutdown; the fleet's TMPDIR for its engines (removed by ``stop``, the unit test
    in tests/test_vllm_cpu.py) must be where real vLLM writes them. Catches a vLLM that reads another
    variable (its sockets would litter the system's temp folder again)."""
    tmp = vllm_fleet.engine_tmp
    assert tmp is not None
    entries = list(tmp.iterdir())
    assert any(p.is_socket() for p in entries), entries
    assert any(p.name.startswith("vllm_dist_") for p in entries), entries


def _gauge(metrics: str, name: str, **labels: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def test_a_cpu_tier_on_real_vllm_is_indexed_predicted_and_timed(
    model_dir: Path, tmp_path: Path, serve_asgi: Callable[..., ThreadedServer]
) -> None:
    """A real vLLM engine with a CPU offload tier (vLLM's own offloading manager and events, the
    host-copy worker of sim/vllm_host_offload.py) behind the router: every turn's cached tokens, as
    the engine reports them, equal the router's prediction, including turns whose history the
    engine loaded from its CPU tier and turns whose history the tier had itself evicted. The
    router's CPU load bandwidth is learned from the engine's own offload counters. Catches: CPU
    events indexed under the wrong tier or not at all (a CPU hit predicted as a miss), CPU
    evictions ignored (a hit predicted that the engine no longer has), and the counters not read
    (no CPU bandwidth learned)."""
    from policies.base import Tier
    from policies.costs import DEFAULT_LOAD_BANDWIDTH_BYTES_PER_S
    from router.service import build_router_app
    from sim.vllm_cpu import VllmCpuProfile
    from tests.vllm.conftest import router_config

    fleet = VllmCpuFleet(tmp_path / "cpu-tier", model_dir=model_dir)
    try:
        fleet.start(
            1, VllmCpuProfile(gpu_blocks=264, cpu_blocks=300, enforce_eager=True, startup_timeout_s=900)
        )
        router = serve_asgi(
            build_router_app(
                router_config(
                    fleet,
                    model_dir,
                    costs={
                        "scrape_interval_s": 0.5,
                        # The tiny model's KV is 1 KiB a token; the CPU tier's prior is left at the
                        # default 64 GB/s, far from a host copy's, with room to move (max_drift).
                        "priors": {
                            "kv_bytes_per_token": 1024,
                            "calibration": {"min_metrics_bytes": 2**20, "max_drift": 1e4},
                        },
                    },
                )
            )
        )
        wait_sources_connected(router.url)
        engine = fleet.engines[0]
        conversations = [Conversation(router.url, 7000 + seed) for seed in range(8)]
        rows = []
        for k in range(5):
            for conv in conversations:
                by_tier = _explain(conv.url, conv.messages, conv.session)["engines"][0][
                    "prefix_blocks_by_tier"
                ]
                _engine, predicted, cached, prompt = conv.turn(k)
                rows.append((conv.seed, k, by_tier["gpu"], by_tier["cpu"], predicted, cached, prompt))
                _barrier(router.url, engine.url, engine.id, f"cpu-{conv.seed}-{k}")
        table = "\n".join(str(r) for r in rows)
        assert all(predicted == cached for *_, predicted, cached, _prompt in rows), table
        # Some turns were served from the CPU tier: history the GPU pool had evicted.
        assert any(
            cpu > 0 and cached > gpu * PROFILE.block_size for _s, _k, gpu, cpu, _p, cached, _pr in rows
        ), table
        # The CPU tier evicted too: some turn found less than its conversation's previous prompt.
        last: dict[int, int] = {}
        lost = []
        for seed, k, _gpu, _cpu, _p, cached, prompt in rows:
            if seed in last and cached < (last[seed] // PROFILE.block_size) * PROFILE.block_size:
                lost.append((seed, k))
            last[seed] = prompt
        assert lost, table
        # The CPU load bandwidth the router learned is the engine's own counters' figure.
        engine_metrics = httpx.get(f"{engine.url}/metrics", timeout=10).text
        load_bytes = _gauge(engine_metrics, "vllm:kv_offload_load_bytes_total")
        load_s = _gauge(engine_metrics, "vllm:kv_offload_load_time_total")
        assert load_bytes and load_s, engine_metrics[-2000:]
        deadline = time.monotonic() + 30
        learned = None
        while learned is None:
            learned = _gauge(
                httpx.get(f"{router.url}/metrics", timeout=10).text,
                "kvroute_cost_load_bandwidth_bytes_per_second",
                engine=engine.id,
                tier="CPU",
            )
            assert learned is not None or time.monotonic() < deadline, "no CPU bandwidth learned"
            time.sleep(0.2)
        # Each counter sample moves the estimate 30% of the way (in log) from the prior to the
        # engine's figure: one sample takes it over 4x below the prior; none leaves it there.
        engine_figure = load_bytes / load_s
        assert engine_figure < 16e9, engine_figure  # the check below needs the two apart
        assert engine_figure / 4 < learned < DEFAULT_LOAD_BANDWIDTH_BYTES_PER_S[Tier.CPU] / 4, (
            learned,
            engine_figure,
        )
    finally:
        fleet.stop()


def test_a_storage_pool_shared_by_two_real_vllm_engines_is_predicted_across_them(
    model_dir: Path, tmp_path: Path, serve_asgi: Callable[..., ThreadedServer]
) -> None:
    """Two real vLLM engines with a CPU tier each and vLLM's fs tier on one folder behind it (a
    STORAGE pool both mount): the router predicts every turn's cached tokens, turns served from
    the pool included, and on the engine that never served a conversation it predicts (and the
    engine reports) the history the other engine wrote to the pool. Catches: STORAGE events not
    indexed, or indexed per engine instead of per pool (no cross-engine hit predicted), and a
    pool prediction the engine does not deliver."""
    from router.service import build_router_app
    from sim.vllm_cpu import VllmCpuProfile, storage_pool_of
    from tests.vllm.conftest import router_config

    storage = tmp_path / "kv-storage"
    storage.mkdir()
    fleet = VllmCpuFleet(tmp_path / "storage-fleet", model_dir=model_dir)
    try:
        prof = VllmCpuProfile(
            gpu_blocks=130,
            max_model_len=4096,
            cpu_blocks=64,
            storage_dir=str(storage),
            enforce_eager=True,
            startup_timeout_s=900,
        )
        fleet.start(2, prof)
        pool = storage_pool_of(str(storage))
        assert {e.storage_pool for e in fleet.engines} == {pool}
        router = serve_asgi(build_router_app(router_config(fleet, model_dir)))
        wait_sources_connected(router.url)
        urls = {e.id: e.url for e in fleet.engines}

        def pool_settled() -> None:
            """The router's pool holds every block file the engines wrote (their STORAGE events
            arrive when the fs tier's writes finish, after the GPU events a barrier waits for)."""
            deadline = time.monotonic() + 60
            while True:
                files = sum(1 for _ in storage.rglob("*.bin"))
                index = httpx.get(f"{router.url}/debug/index", timeout=10).json()["index"]
                if index["storage_pools"].get(pool, {}).get("blocks") == files:
                    return
                assert time.monotonic() < deadline, (files, index["storage_pools"])
                time.sleep(0.1)

        # Ten conversations of up to ~45 blocks on pools of 130 (GPU) and 64 (CPU) blocks each.
        conversations = [Conversation(router.url, 8000 + seed) for seed in range(10)]
        rows = []
        for k in range(4):
            for conv in conversations:
                pool_settled()
                explain = _explain(conv.url, conv.messages, conv.session)
                engine, predicted, cached, _prompt = conv.turn(k)
                (tiers,) = (
                    e["prefix_blocks_by_tier"] for e in explain["engines"] if e["engine_id"] == engine
                )
                rows.append(
                    (conv.seed, k, engine, tiers["gpu"], tiers["cpu"], tiers["storage"], predicted, cached)
                )
                _barrier(router.url, urls[engine], engine, f"fs-{conv.seed}-{k}")
        table = "\n".join(str(r) for r in rows)
        assert all(predicted == cached for *_, predicted, cached in rows), table
        assert any(storage_blocks > 0 for *_, storage_blocks, _p, _c in rows), table
        # Across the engines: each conversation's history on the engine that did not serve its
        # last turn, predicted from the pool and checked against that engine's own report.
        crossed = []
        for conv in conversations:
            pool_settled()
            served = rows[[r[0] for r in rows].index(conv.seed) + 3 * len(conversations)][2]
            (other,) = (e for e in urls if e != served)
            explain = _explain(conv.url, conv.messages, conv.session)
            (entry,) = (e for e in explain["engines"] if e["engine_id"] == other)
            if entry["prefix_blocks_by_tier"]["storage"] == 0:
                continue
            reply = httpx.post(
                f"{urls[other]}/v1/chat/completions",
                json={"model": MODEL_NAME, "messages": conv.messages, "max_tokens": 1},
                timeout=300,
            ).json()
            crossed.append(
                (
                    conv.seed,
                    other,
                    entry["prefix_tokens"],
                    reply["usage"]["prompt_tokens_details"]["cached_tokens"],
                )
            )
            _barrier(router.url, urls[other], other, f"fs-cross-{conv.seed}")
        assert crossed and all(p == c for _s, _e, p, c in crossed), (crossed, table)
    finally:
        fleet.stop()
