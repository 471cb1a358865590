"""The simulated engine behind vLLM's real interfaces: OpenAI API, /tokenize, /metrics, KV events.

An asyncio task steps the pure EngineCore in (optionally scaled) real time, streams each request's
tokens to its HTTP response and publishes each step's KV events on ZMQ in vLLM 0.33's wire format.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvcore import sim_tokenizer as tokenizer
from kvcore.core import SCHEDULING_POLICIES
from sim.cache import StoragePool
from sim.engine import EngineCore, EngineProfile, EngineStats, FinishedRequest, SimRequest
from sim.zmq_publisher import KVEventsConfig, ZmqEventPublisher, parse_kv_events_config, resolved_source

log = logging.getLogger(__name__)

VLLM_VERSION = "0.33.0"
TIER_NAMES = ("GPU", "CPU", "STORAGE")


@dataclass(slots=True)
class EngineServerConfig:
    """Everything one simulated engine server needs; the CLI flags map 1:1 onto these fields."""

    host: str = "127.0.0.1"
    port: int = 8000
    engine_id: str = "e0"
    model: str = tokenizer.NAME
    block_size: int = 16
    #: None = the profile's default (27,852: one H100 with Llama-3-8B).
    gpu_blocks: int | None = None
    cpu_blocks: int = 0
    #: Id of the STORAGE pool (None = no storage tier). Engines naming the same pool id and the
    #: same ``storage_dir`` share it (see sim/storage_share.py).
    storage_pool: str | None = None
    storage_blocks: int = 0
    #: Directory that backs a shared storage pool across processes; None = per-process pool.
    storage_dir: str | None = None
    max_model_len: int | None = None
    #: Real time runs this many times faster than the model's time (10 = 10x faster).
    time_scale: float = 1.0
    #: Answer at once with ``zero_delay_output_tokens`` filler tokens; no engine, no events.
    zero_delay: bool = False
    zero_delay_output_tokens: int = 4
    #: max_tokens when a request leaves it out (vLLM would use max_model_len - prompt).
    default_max_tokens: int = 16
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    hash_algo: str = "sha256"
    self_describing_cpu_events: bool = False
    seed: int = 0
    #: vLLM's --scheduling-policy: "fcfs", or "priority" (requests' ``priority`` orders the queue).
    scheduling_policy: str = "fcfs"
    #: LoRA adapter names served on top of ``model`` (vLLM's --lora-modules), listed by
    #: GET /v1/models with ``parent`` = the base model.
    lora_modules: tuple[str, ...] = ()
    #: Any other EngineProfile fields (e.g. prefill_tokens_per_s), applied after the flags above.
    profile_overrides: dict[str, Any] = field(default_factory=dict)


def build_profile(cfg: EngineServerConfig) -> EngineProfile:
    """The engine profile for ``cfg``: defaults, then the flags that were given."""
    kwargs: dict[str, Any] = {
        "block_size": cfg.block_size,
        "num_cpu_blocks": cfg.cpu_blocks,
        "hash_algo": cfg.hash_algo,
        "self_describing_cpu_events": cfg.self_describing_cpu_events,
        "scheduling_policy": cfg.scheduling_policy,
    }
    if cfg.gpu_blocks is not None:
        kwargs["num_gpu_blocks"] = cfg.gpu_blocks
    if cfg.max_model_len is not None:
        kwargs["max_model_len"] = cfg.max_model_len
    kwargs.update(cfg.profile_overrides)
    return EngineProfile(**kwargs)


class ApiError(Exception):
    """An error answered as OpenAI-shaped JSON with an HTTP status."""

    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type


def error_response(message: str, status: int = 400, err_type: str = "BadRequestError") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": err_type, "code": status}}, status_code=status)


# ----------------------------------------------------------------------------------------------
# Shared STORAGE across engine processes


class DirectoryStoragePool(StoragePool):
    """A STORAGE pool several engine processes share through a directory, like vLLM's fs tier.

    Each block is a zero-byte file named by the engine block hash (hex); the file's mtime is its
    LRU age. Engine hashes are deterministic (no random seed), so a block stored by one engine is a
    hit for every engine mounting the same directory. Capacity is enforced by a trim (oldest mtimes
    first) every ``capacity_blocks // 16 + 1`` new blocks, so the pool may overshoot by that much.
    File operations are a few microseconds each; they run inside the engine step.
    """

    def __init__(self, pool_id: str, capacity_blocks: int, directory: str) -> None:
        super().__init__(pool_id, capacity_blocks)
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self._puts_since_trim = 0
        self._trim_every = capacity_blocks // 16 + 1

    def _path(self, block_hash: int) -> str:
        return os.path.join(self.directory, f"{block_hash:016x}")

    def __len__(self) -> int:
        return len(os.listdir(self.directory))

    def __contains__(self, block_hash: object) -> bool:
        return isinstance(block_hash, int) and os.path.exists(self._path(block_hash))

    def hashes(self) -> list[int]:
        entries = []
        with os.scandir(self.directory) as it:
            for entry in it:
                with contextlib.suppress(FileNotFoundError, ValueError):
                    entries.append((entry.stat().st_mtime_ns, int(entry.name, 16)))
        return [h for _mtime, h in sorted(entries)]

    def touch(self, block_hash: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.utime(self._path(block_hash))

    def write(self, block_hashes: Sequence[int], evicted: list[int]) -> list[int] | None:
        """LruBlockTier.write's admission on the shared directory: a write the pool cannot hold
        whole is refused; a file another engine created first is a block already held."""
        if len(block_hashes) > self.capacity_blocks:
            return None
        new = []
        for block_hash in block_hashes:
            try:
                fd = os.open(self._path(block_hash), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                continue
            os.close(fd)
            new.append(block_hash)
        self._puts_since_trim += len(new)
        if self._puts_since_trim >= self._trim_every:
            self._puts_since_trim = 0
            self._trim(evicted, set(block_hashes))
        return new

    def _trim(self, evicted: list[int], written: set[int]) -> None:
        ordered = [h for h in self.hashes() if h not in written]
        for block_hash in ordered[: max(0, len(ordered) + len(written) - self.capacity_blocks)]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(block_hash))
            evicted.append(block_hash)

    def clear(self) -> None:
        for block_hash in self.hashes():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(block_hash))


def make_storage_pool(cfg: EngineServerConfig) -> StoragePool | None:
    """The engine's STORAGE tier: none, a per-process pool, or a directory shared across processes."""
    if not cfg.storage_pool:
        return None
    if cfg.storage_blocks <= 0:
        raise ValueError(f"--storage-pool {cfg.storage_pool!r} needs --storage-blocks > 0")
    if cfg.storage_dir:
        return DirectoryStoragePool(cfg.storage_pool, cfg.storage_blocks, cfg.storage_dir)
    return StoragePool(cfg.storage_pool, cfg.storage_blocks)


# ----------------------------------------------------------------------------------------------
# The engine loop


@dataclass(slots=True)
class _Stream:
    """Per-request channel from the engine loop to the HTTP handler."""

    queue: asyncio.Queue[list[int] | FinishedRequest] = field(default_factory=asyncio.Queue)
    arrival_s: float = field(default_factory=time.monotonic)
    first_token_seen: bool = False


class EngineRunner:
    """Owns the EngineCore and the task that steps it; the only code that touches the core."""

    def __init__(
        self,
        core: EngineCore,
        publisher: ZmqEventPublisher | None,
        time_scale: float,
        on_first_token: Callable[[float], None],
    ) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.core = core
        self.publisher = publisher
        self.time_scale = time_scale
        self._on_first_token = on_first_token
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.steps = 0
        self.failed: BaseException | None = None
        # Set by a prefix-cache reset so that one step runs even when idle: it carries AllBlocksCleared.
        self._flush_events = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    def submit(self, req: SimRequest) -> _Stream:
        """Queue a request; ValueError (bad or too long) goes back to the caller as a 400."""
        if req.request_id in self._streams:
            raise ValueError(f"request_id {req.request_id!r} is already running; use a unique request_id")
        self.core.add_request(req)
        stream = _Stream()
        self._streams[req.request_id] = stream
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Client went away: free the request's blocks in the engine."""
        if self._streams.pop(request_id, None) is not None:
            self.core.abort_request(request_id)
            self._wake.set()

    def reset_prefix_cache(self, reset_connector: bool = False) -> None:
        self.core.reset_prefix_cache(reset_connector)
        self._flush_events = True
        self._wake.set()

    async def _run(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self.core.has_unfinished() or self._flush_events:
                    self._flush_events = False
                    out = self.core.step()
                    self.steps += 1
                    # The model says the step took duration_s: results exist only after that.
                    await asyncio.sleep(max(0.0, out.duration_s) / self.time_scale)
                    if out.events and self.publisher is not None:
                        self.publisher.publish(out.events)
                    self._deliver(out.new_token_ids, out.finished)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the engine model broke: /health turns 503, clients get errors
            log.exception("engine loop failed")
            self.failed = exc
            for stream in self._streams.values():
                stream.queue.put_nowait(FinishedRequest("?", 0, [], 0, (0, 0, 0), "abort"))
            raise

    def _deliver(self, new_token_ids: Mapping[str, list[int]], finished: Iterable[FinishedRequest]) -> None:
        now = time.monotonic()
        for rid, tokens in new_token_ids.items():
            stream = self._streams.get(rid)
            if stream is None or not tokens:
                continue
            if not stream.first_token_seen:
                stream.first_token_seen = True
                self._on_first_token((now - stream.arrival_s) * self.time_scale)
            stream.queue.put_nowait(list(tokens))
        for fin in finished:
            stream = self._streams.pop(fin.request_id, None)
            if stream is not None:
                stream.queue.put_nowait(fin)


# ----------------------------------------------------------------------------------------------
# Metrics


class EngineStatsCollector(Collector):
    """Reads the engine's counters at scrape time and exposes them under vLLM's metric names.

    Labels: ``model_name`` and ``engine`` on everything; ``source`` of
    prompt_tokens_cached_by_source is the tier name (GPU/CPU/STORAGE); kv_offload load/store
    counters carry ``medium`` = CPU or STORAGE (same spelling as the events' medium).
    """

    def __init__(self, app_state: ServerState) -> None:
        self._state = app_state

    def collect(self) -> Iterable[Any]:
        st = self._state
        labels = {"model_name": st.config.model, "engine": st.config.engine_id}
        names = list(labels)
        values = list(labels.values())
        # Zero-delay servers have no engine: every counter reads 0.
        stats = st.runner.core.stats() if st.runner is not None else EngineStats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "GPU KV-cache usage (0..1).", stats.kv_cache_usage)
        yield counter(
            "vllm:prefix_cache_queries",
            "GPU prefix-cache queried tokens.",
            stats.prefix_cache_queries_tokens,
        )
        yield counter(
            "vllm:prefix_cache_hits", "GPU prefix-cache hit tokens.", stats.prefix_cache_hits_tokens
        )
        yield counter(
            "vllm:external_prefix_cache_queries",
            "Offload-tier queried tokens.",
            stats.external_prefix_cache_queries_tokens,
        )
        yield counter(
            "vllm:external_prefix_cache_hits",
            "Offload-tier hit tokens.",
            stats.external_prefix_cache_hits_tokens,
        )
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_cached_by_source",
            "Cached prompt tokens by the tier they came from.",
            labels=[*names, "source"],
        )
        for tier, value in zip(TIER_NAMES, stats.cached_tokens_by_tier, strict=True):
            by_source.add_metric([*values, tier], value)
        yield by_source
        for direction in ("load", "store"):
            bytes_fam = CounterMetricFamily(
                f"vllm:kv_offload_{direction}_bytes",
                f"KV bytes moved per tier ({direction}).",
                labels=[*names, "medium"],
            )
            time_fam = CounterMetricFamily(
                f"vllm:kv_offload_{direction}_time",
                f"Model seconds spent on KV {direction}s per tier.",
                labels=[*names, "medium"],
            )
            moved_bytes = getattr(stats, f"{direction}_bytes_by_tier")
            moved_time_s = getattr(stats, f"{direction}_time_s_by_tier")
            for tier in TIER_NAMES[1:]:
                bytes_fam.add_metric([*values, tier], moved_bytes.get(tier, 0))
                time_fam.add_metric([*values, tier], moved_time_s.get(tier, 0.0))
            yield bytes_fam
            yield time_fam
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Cache configuration (value is always 1).",
            labels=[
                *names,
                "block_size",
                "num_gpu_blocks",
                "num_cpu_blocks",
                "prefix_caching_hash_algo",
                "enable_prefix_caching",
                "storage_pool",
                "storage_blocks",
            ],
        )
        profile = st.profile
        info.add_metric(
            [
                *values,
                str(profile.block_size),
                str(profile.num_gpu_blocks),
                str(profile.num_cpu_blocks),
                profile.hash_algo,
                "True",
                st.config.storage_pool or "",
                str(st.config.storage_blocks if st.config.storage_pool else 0),
            ],
            1.0,
        )
        yield info


# ----------------------------------------------------------------------------------------------
# The HTTP app


@dataclass(slots=True)
class ServerState:
    config: EngineServerConfig
    profile: EngineProfile
    registry: CollectorRegistry
    ttft: Histogram
    runner: EngineRunner | None = None
    publisher: ZmqEventPublisher | None = None
    created_s: int = field(default_factory=lambda: int(time.time()))


def _check_model(state: ServerState, body: Mapping[str, Any]) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise ApiError("'model' must be a string")
    if model != state.config.model and model not in state.config.lora_modules:
        raise ApiError(f"The model `{model}` does not exist.", status=404, err_type="NotFoundError")


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    return body


def _opt_int(body: Mapping[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"'{key}' must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise ApiError(f"'{key}' must be >= {minimum}, got {value}")
    return value


def _opt_number(body: Mapping[str, Any], key: str) -> None:
    value = body.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise ApiError(f"'{key}' must be a number, got {type(value).__name__}")


def _opt_str(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise ApiError(f"'{key}' must be a string, got {type(value).__name__}")
    return value


@dataclass(slots=True)
class _Sampling:
    max_tokens: int
    stream: bool
    include_usage: bool
    cache_salt: str | None
    request_id: str
    raw: dict[str, Any]
    #: The LoRA adapter the request names as its model (vLLM folds it into every block's key).
    lora_name: str | None = None
    #: vLLM's ``priority`` (lower first; read only by a --scheduling-policy priority engine).
    priority: int = 0


#: vLLM's request header for ``priority``; when present it overrides the body's (vLLM docs,
#: "OpenAI-compatible server": the value must be an integer).
PRIORITY_HEADER = "x-vllm-priority"
_MIN_PRIORITY = -(1 << 62)


def _priority(body: Mapping[str, Any], headers: Mapping[str, str]) -> int:
    """The request's vLLM priority: the X-Vllm-Priority header when sent, else the body's
    ``priority``, else 0. An fcfs engine accepts and ignores it, as vLLM does."""
    header = headers.get(PRIORITY_HEADER)
    if header is None:
        return _opt_int(body, "priority", _MIN_PRIORITY) or 0
    try:
        value = int(header.strip())
    except ValueError:
        raise ApiError(f"header 'X-Vllm-Priority' must be an integer, got {header!r}") from None
    if value < _MIN_PRIORITY:
        raise ApiError(f"header 'X-Vllm-Priority' must be >= {_MIN_PRIORITY}, got {value}")
    return value


def _parse_sampling(
    state: ServerState,
    body: Mapping[str, Any],
    prompt_lens: list[int],
    id_prefix: str,
    *,
    chat: bool,
    headers: Mapping[str, str],
) -> _Sampling:
    for key in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        _opt_number(body, key)
    n = _opt_int(body, "n", 1)
    if n not in (None, 1):
        raise ApiError("'n' > 1 is not supported by the simulator; send n=1")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError("'stream' must be a boolean")
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise ApiError("'stream_options' must be an object")
        if not stream:
            raise ApiError("Stream options can only be defined when `stream=True`.")
        include_usage = bool(stream_options.get("include_usage", False))
    cache_salt = _opt_str(body, "cache_salt")
    if cache_salt == "":
        raise ApiError("'cache_salt' must be a non-empty string when given")
    request_id = _opt_str(body, "request_id") or f"{id_prefix}-{uuid.uuid4().hex}"
    max_model_len = state.profile.max_model_len
    max_tokens = _opt_int(body, "max_completion_tokens", 1) if chat else None
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", 1)
    longest = max(prompt_lens)
    if longest >= max_model_len:
        raise ApiError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{longest} input tokens. Please reduce the length of the input messages."
        )
    if max_tokens is None:
        max_tokens = min(state.config.default_max_tokens, max_model_len - longest)
    elif longest + max_tokens > max_model_len:
        raise ApiError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{longest + max_tokens} tokens ({longest} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion."
        )
    raw = {
        "n": 1,
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "max_tokens": max_tokens,
        "min_tokens": body.get("min_tokens", 0),
        "ignore_eos": True,
        "seed": body.get("seed"),
    }
    model = body.get("model")
    lora_name = model if isinstance(model, str) and model in state.config.lora_modules else None
    priority = _priority(body, headers)
    return _Sampling(max_tokens, stream, include_usage, cache_salt, request_id, raw, lora_name, priority)


def _chat_prompt(body: Mapping[str, Any]) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list of message objects")
    add_gen = body.get("add_generation_prompt", True)
    if not isinstance(add_gen, bool):
        raise ApiError("'add_generation_prompt' must be a boolean")
    try:
        return tokenizer.encode_chat(messages, add_generation_prompt=add_gen)
    except ValueError as exc:
        raise ApiError(str(exc)) from None


def _completion_prompts(body: Mapping[str, Any]) -> list[list[int]]:
    """``prompt`` as a string, list of strings, token ids or list of token-id lists -> token lists."""
    prompt = body.get("prompt")
    bad = "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists"
    if isinstance(prompt, str):
        return [tokenizer.encode_prompt(prompt)]
    if not isinstance(prompt, list) or not prompt:
        raise ApiError(bad)
    if all(isinstance(p, str) for p in prompt):
        return [tokenizer.encode_prompt(p) for p in prompt]
    if all(_is_token_list(p) for p in prompt):
        return [list(p) for p in prompt]
    if _is_token_list(prompt):
        return [list(prompt)]
    raise ApiError(bad)


def _is_token_list(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < tokenizer.VOCAB_LIMIT for t in value
        )
    )


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(slots=True)
class _Result:
    index: int
    prompt_tokens: int
    output_token_ids: list[int]
    cached_tokens: int
    finish_reason: str


async def _generate(
    state: ServerState, request_id: str, prompt: list[int], sampling: _Sampling
) -> AsyncGenerator[list[int] | FinishedRequest, None]:
    """Yield token deltas then the FinishedRequest; aborts the engine request if the caller stops."""
    cfg = state.config
    if cfg.zero_delay or state.runner is None:
        tokens = tokenizer.filler_tokens(min(cfg.zero_delay_output_tokens, sampling.max_tokens), cfg.seed)
        state.ttft.observe(0.0)
        yield tokens
        yield FinishedRequest(request_id, len(prompt), tokens, 0, (0, 0, 0), "length")
        return
    if state.runner.failed is not None:
        raise ApiError(
            "the engine loop has failed; restart the engine", status=500, err_type="InternalServerError"
        )
    try:
        stream = state.runner.submit(
            SimRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                max_tokens=sampling.max_tokens,
                cache_salt=sampling.cache_salt,
                lora_name=sampling.lora_name,
                priority=sampling.priority,
            )
        )
    except ValueError as exc:
        raise ApiError(str(exc)) from None
    finished = False
    try:
        while True:
            item = await stream.queue.get()
            if isinstance(item, FinishedRequest):
                finished = True
                yield item
                return
            yield item
    finally:
        if not finished:
            state.runner.abort(request_id)


async def _collect(
    state: ServerState, base_id: str, prompts: list[list[int]], sampling: _Sampling
) -> list[_Result]:
    async def one(i: int, prompt: list[int]) -> _Result:
        rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
        async for item in _generate(state, rid, prompt, sampling):
            if isinstance(item, FinishedRequest):
                return _Result(
                    i, item.prompt_tokens, item.output_token_ids, item.cached_tokens, item.finish_reason
                )
        raise ApiError("request ended without a result", status=500, err_type="InternalServerError")

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def _sse_chunk(
    rid: str,
    object_name: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
) -> bytes:
    """One streamed chunk as vLLM sends it (``usage`` only on the final usage chunk)."""
    obj: dict[str, Any] = {
        "id": rid,
        "object": object_name,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        obj["usage"] = usage
    return _sse(obj)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def create_engine_app(config: EngineServerConfig) -> FastAPI:
    """Build the engine server app; the engine loop and the ZMQ publisher live in its lifespan."""
    profile = build_profile(config)
    registry = CollectorRegistry(auto_describe=True)
    ttft = Histogram(
        "vllm:time_to_first_token_seconds",
        "Time to first token in model seconds (wall time x time_scale).",
        labelnames=("model_name", "engine"),
        buckets=(
            0.001,
            0.005,
            0.01,
            0.02,
            0.04,
            0.06,
            0.08,
            0.1,
            0.25,
            0.5,
            0.75,
            1.0,
            2.5,
            5.0,
            7.5,
            10.0,
            20.0,
            40.0,
            80.0,
        ),
        registry=registry,
    )
    ttft_child = ttft.labels(model_name=config.model, engine=config.engine_id)
    state = ServerState(config=config, profile=profile, registry=registry, ttft=ttft_child)  # type: ignore[arg-type]
    registry.register(EngineStatsCollector(state))

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        publisher: ZmqEventPublisher | None = None
        if (
            config.kv_events.enable_kv_cache_events
            and config.kv_events.publisher == "zmq"
            and not config.zero_delay
        ):
            publisher = ZmqEventPublisher(config.kv_events)
            publisher.start()
        state.publisher = publisher
        if not config.zero_delay:
            storage = make_storage_pool(config)
            core = EngineCore(config.engine_id, profile, storage=storage, seed=config.seed)
            state.runner = EngineRunner(core, publisher, config.time_scale, ttft_child.observe)
            state.runner.start()
        try:
            yield
        finally:
            if state.runner is not None:
                await state.runner.close()
            if publisher is not None:
                await publisher.close()

    app = FastAPI(title=f"kvroute sim engine {config.engine_id}", lifespan=lifespan)
    app.state.sim = state

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        log.info("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
        return error_response(exc.message, exc.status, exc.err_type)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(f"internal error: {type(exc).__name__}", 500, "InternalServerError")

    _add_info_routes(app, state)
    _add_render_routes(app, state)
    _add_completion_routes(app, state)
    return app


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    """Health, version, models, KV event sources, metrics, prefix-cache reset and (de)tokenize."""
    config, profile, registry = state.config, state.profile, state.registry

    @app.get("/health")
    async def health() -> Response:
        if not config.zero_delay and (state.runner is None or not state.runner.alive):
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VLLM_VERSION}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": config.model,
                    "object": "model",
                    "created": state.created_s,
                    "owned_by": "vllm",
                    "root": config.model,
                    "parent": None,
                    "max_model_len": profile.max_model_len,
                },
                *(
                    {
                        "id": name,
                        "object": "model",
                        "created": state.created_s,
                        "owned_by": "vllm",
                        "root": f"/adapters/{name}",
                        "parent": config.model,
                        "max_model_len": profile.max_model_len,
                    }
                    for name in config.lora_modules
                ),
            ],
        }

    @app.get("/kv_event_sources")
    async def kv_event_sources() -> dict[str, Any]:
        if not config.kv_events.enable_kv_cache_events or config.zero_delay:
            return {}
        return {"0": resolved_source(config.kv_events, config.host)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_external: bool = False) -> dict[str, bool]:
        # vLLM 0.32 answers {"success": bool} (false while blocks are held); this engine preempts
        # what runs, so its reset always succeeds. ``reset_external=true`` also empties the CPU
        # tier (vLLM's offloading connector resets its primary tier; the STORAGE pool stays).
        if state.runner is not None:
            state.runner.reset_prefix_cache(reset_external)
        return {"success": True}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await _json_body(request)
        _check_model(state, body)
        if "messages" in body:
            tokens = _chat_prompt(body)
        elif isinstance(body.get("prompt"), str):
            add_special = body.get("add_special_tokens", True)
            tokens = (
                tokenizer.encode_prompt(body["prompt"])
                if add_special
                else tokenizer.encode_text(body["prompt"])
            )
        else:
            raise ApiError("send either 'prompt' (a string) or 'messages' (a list of chat messages)")
        return {
            "count": len(tokens),
            "max_model_len": profile.max_model_len,
            "tokens": tokens,
            "token_strs": None,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await _json_body(request)
        _check_model(state, body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise ApiError("'tokens' must be a list of integer token ids")
        return {"prompt": tokenizer.decode(tokens)}


def _add_render_routes(app: FastAPI, state: ServerState) -> None:
    """vLLM's /render endpoints: the engine request a completion would become, without running it."""
    config = state.config

    def _render(body: Mapping[str, Any], prompt: list[int], sampling: _Sampling) -> dict[str, Any]:
        return {
            "request_id": sampling.request_id,
            "token_ids": prompt,
            "sampling_params": sampling.raw,
            "model": config.model,
            "stream": sampling.stream,
            "stream_options": body.get("stream_options"),
            "cache_salt": sampling.cache_salt,
            "priority": sampling.priority,
            "kv_transfer_params": body.get("kv_transfer_params"),
        }

    @app.post("/v1/chat/completions/render")
    async def chat_render(request: Request) -> dict[str, Any]:
        body = await _json_body(request)
        _check_model(state, body)
        prompt = _chat_prompt(body)
        sampling = _parse_sampling(state, body, [len(prompt)], "chatcmpl", chat=True, headers=request.headers)
        return _render(body, prompt, sampling)

    @app.post("/v1/completions/render")
    async def completions_render(request: Request) -> list[dict[str, Any]]:
        body = await _json_body(request)
        _check_model(state, body)
        prompts = _completion_prompts(body)
        sampling = _parse_sampling(
            state, body, [len(p) for p in prompts], "cmpl", chat=False, headers=request.headers
        )
        return [_render(body, p, sampling) for p in prompts]


def _add_completion_routes(app: FastAPI, state: ServerState) -> None:
    """/v1/chat/completions and /v1/completions, streamed or not, through the engine loop."""
    config = state.config

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        body = await _json_body(request)
        _check_model(state, body)
        prompt = _chat_prompt(body)
        sampling = _parse_sampling(state, body, [len(prompt)], "chatcmpl", chat=True, headers=request.headers)
        created = int(time.time())
        rid = sampling.request_id
        if not sampling.stream:
            (res,) = await _collect(state, rid, [prompt], sampling)
            return JSONResponse(
                {
                    "id": rid,
                    "object": "chat.completion",
                    "created": created,
                    "model": config.model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {
                                "role": "assistant",
                                "content": tokenizer.decode(res.output_token_ids, skip_special=True),
                                "refusal": None,
                                "tool_calls": [],
                            },
                            "logprobs": None,
                            "finish_reason": res.finish_reason,
                            "stop_reason": None,
                        }
                    ],
                    "usage": _usage(res.prompt_tokens, len(res.output_token_ids), res.cached_tokens),
                    "prompt_logprobs": None,
                    "kv_transfer_params": None,
                }
            )
        gen = _generate(state, rid, prompt, sampling)
        # Admission errors (too long for the engine, duplicate id) must be a 400, not a broken stream.
        first = await _first_or_gone(state, request, gen)
        if first is None:
            return Response(status_code=CLIENT_GONE)

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            return _sse_chunk(rid, "chat.completion.chunk", created, config.model, choices, usage)

        async def body_iter() -> AsyncIterator[bytes]:
            n_out = 0
            try:
                yield chunk(
                    [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
                item = first
                while True:
                    if isinstance(item, FinishedRequest):
                        yield chunk(
                            [
                                {
                                    "index": 0,
                                    "delta": {},
                                    "logprobs": None,
                                    "finish_reason": item.finish_reason,
                                    "stop_reason": None,
                                }
                            ]
                        )
                        if sampling.include_usage:
                            yield chunk([], _usage(item.prompt_tokens, n_out, item.cached_tokens))
                        break
                    n_out += len(item)
                    text = tokenizer.decode(item, skip_special=True)
                    yield chunk(
                        [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]
                    )
                    item = await anext(gen)
                yield b"data: [DONE]\n\n"
            finally:
                await gen.aclose()

        return StreamingResponse(body_iter(), media_type="text/event-stream")

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        body = await _json_body(request)
        _check_model(state, body)
        prompts = _completion_prompts(body)
        sampling = _parse_sampling(
            state, body, [len(p) for p in prompts], "cmpl", chat=False, headers=request.headers
        )
        created = int(time.time())
        rid = sampling.request_id
        if not sampling.stream:
            results = await _collect(state, rid, prompts, sampling)
            return JSONResponse(
                {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": config.model,
                    "choices": [
                        {
                            "index": r.index,
                            "text": tokenizer.decode(r.output_token_ids, skip_special=True),
                            "logprobs": None,
                            "finish_reason": r.finish_reason,
                            "stop_reason": None,
                            "prompt_logprobs": None,
                        }
                        for r in results
                    ],
                    "usage": _usage(
                        sum(r.prompt_tokens for r in results),
                        sum(len(r.output_token_ids) for r in results),
                        sum(r.cached_tokens for r in results),
                    ),
                    "kv_transfer_params": None,
                }
            )

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            return _sse_chunk(rid, "text_completion", created, config.model, choices, usage)

        gens = [
            _generate(state, rid if len(prompts) == 1 else f"{rid}-{i}", p, sampling)
            for i, p in enumerate(prompts)
        ]
        firsts: list[list[int] | FinishedRequest] = []
        for g in gens:
            item = await _first_or_gone(state, request, g)
            if item is None:
                for other in gens:
                    await other.aclose()
                return Response(status_code=CLIENT_GONE)
            firsts.append(item)
        merged: asyncio.Queue[tuple[int, list[int] | FinishedRequest]] = asyncio.Queue()

        async def pump(i: int, gen: AsyncIterator[list[int] | FinishedRequest]) -> None:
            async for item in gen:
                merged.put_nowait((i, item))

        async def body_iter() -> AsyncIterator[bytes]:
            for i, item in enumerate(firsts):
                merged.put_nowait((i, item))
            pumps = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
            done = 0
            prompt_total = cached_total = out_total = 0
            try:
                while done < len(gens):
                    i, item = await merged.get()
                    if isinstance(item, FinishedRequest):
                        done += 1
                        prompt_total += item.prompt_tokens
                        cached_total += item.cached_tokens
                        yield chunk(
                            [
                                {
                                    "index": i,
                                    "text": "",
                                    "logprobs": None,
                                    "finish_reason": item.finish_reason,
                                    "stop_reason": None,
                                }
                            ]
                        )
                    else:
                        out_total += len(item)
                        yield chunk(
                            [
                                {
                                    "index": i,
                                    "text": tokenizer.decode(item, skip_special=True),
                                    "logprobs": None,
                                    "finish_reason": None,
                                    "stop_reason": None,
                                }
                            ]
                        )
                if sampling.include_usage:
                    yield chunk([], _usage(prompt_total, out_total, cached_total))
                yield b"data: [DONE]\n\n"
            finally:
                for task in pumps:
                    task.cancel()
                for task in pumps:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                for g in gens:
                    await g.aclose()

        return StreamingResponse(body_iter(), media_type="text/event-stream")


#: The status a stream's handler ends with when its client left before its first token (nginx's
#: 499; nothing reads it, the connection being gone).
CLIENT_GONE = 499


async def _first_item(gen: AsyncIterator[list[int] | FinishedRequest]) -> list[int] | FinishedRequest:
    try:
        return await anext(gen)
    except StopAsyncIteration:
        raise ApiError("request ended without output", status=500, err_type="InternalServerError") from None


async def _client_gone(request: Request) -> None:
    """Return once the client's connection is gone (its body has been read in full already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _first_or_gone(
    state: ServerState, request: Request, gen: AsyncGenerator[list[int] | FinishedRequest, None]
) -> list[int] | FinishedRequest | None:
    """A stream's first item, or None if its client left first: then the request is aborted in the
    engine at once (its generator closed). vLLM drops a queued stream whose client
    leaves, before its first token (measured on vLLM 0.32's CPU build:
    docs/results/q25/abort_check.py); the response would otherwise find the closed connection only
    when it first writes. A zero-delay engine answers at once: nothing to watch."""
    if state.config.zero_delay or state.runner is None:
        return await _first_item(gen)
    first = asyncio.ensure_future(_first_item(gen))
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait((first, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (first, gone):
            if not task.done():
                task.cancel()
        await asyncio.gather(first, gone, return_exceptions=True)
    if first.done() and not first.cancelled():
        return first.result()
    await gen.aclose()
    return None


# ----------------------------------------------------------------------------------------------
# Running it


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class ThreadedEngineServer:
    """Runs an engine app with uvicorn in a background thread (for tests in the same process).

    Use as a context manager; ``url`` is ``http://host:port``. The thread owns its own event loop,
    so the engine loop and the ZMQ replay task are cancelled by the app's lifespan on exit.
    """

    def __init__(self, config: EngineServerConfig) -> None:
        if config.port == 0:
            config.port = free_port(config.host)
        self.config = config
        self.app = create_engine_app(config)
        self._server = uvicorn.Server(
            uvicorn.Config(self.app, host=config.host, port=config.port, log_level="warning", lifespan="on")
        )
        self._thread = threading.Thread(
            target=self._server.run, name=f"engine-{config.engine_id}", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def start(self, timeout_s: float = 10.0) -> ThreadedEngineServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"engine server {self.config.engine_id} did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def __enter__(self) -> ThreadedEngineServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvroute engine", description="Run one simulated vLLM engine server.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--engine-id", default="e0")
    p.add_argument("--model", default=tokenizer.NAME)
    p.add_argument("--gpu-blocks", type=int, default=None, help="GPU KV pool size in blocks")
    p.add_argument("--cpu-blocks", type=int, default=0, help="CPU offload tier in blocks (0 = none)")
    p.add_argument("--storage-pool", default=None, help="storage pool id (engines with the same id share it)")
    p.add_argument("--storage-blocks", type=int, default=0, help="storage pool capacity in blocks")
    p.add_argument(
        "--storage-dir", default=None, help="directory backing a storage pool shared across processes"
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--time-scale", type=float, default=1.0, help="run N times faster than the model's time")
    p.add_argument("--zero-delay", action="store_true", help="answer at once with a fixed small output")
    p.add_argument("--default-max-tokens", type=int, default=16)
    p.add_argument("--kv-events-config", default=None, help="vLLM's --kv-events-config JSON")
    p.add_argument("--hash-algo", choices=("sha256", "sha256_cbor"), default="sha256")
    p.add_argument("--self-describing-cpu-events", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
        help="vLLM's: fcfs, or priority (a request's 'priority' field or X-Vllm-Priority header orders"
        " the queue, lower first; an fcfs engine ignores it)",
    )
    p.add_argument(
        "--profile-overrides",
        default=None,
        help="JSON object of other EngineProfile fields, e.g. '{\"prefill_tokens_per_s\": 8000}'",
    )
    p.add_argument("--lora-modules", nargs="*", default=(), help="LoRA adapter names served on the model")
    p.add_argument("--log-level", default="warning")
    return p


def config_from_args(args: argparse.Namespace) -> EngineServerConfig:
    return EngineServerConfig(
        host=args.host,
        port=args.port,
        engine_id=args.engine_id,
        model=args.model,
        block_size=args.block_size,
        gpu_blocks=args.gpu_blocks,
        cpu_blocks=args.cpu_blocks,
        storage_pool=args.storage_pool,
        storage_blocks=args.storage_blocks,
        storage_dir=args.storage_dir,
        max_model_len=args.max_model_len,
        time_scale=args.time_scale,
        zero_delay=args.zero_delay,
        default_max_tokens=args.default_max_tokens,
        kv_events=parse_kv_events_config(args.kv_events_config),
        hash_algo=args.hash_algo,
        self_describing_cpu_events=args.self_describing_cpu_events,
        seed=args.seed,
        scheduling_policy=args.scheduling_policy,
        profile_overrides=json.loads(args.profile_overrides) if args.profile_overrides else {},
        lora_modules=tuple(args.lora_modules),
    )


def main(argv: list[str] | None = None) -> int:
    """``kvroute engine``: serve one simulated engine until SIGINT/SIGTERM."""
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = config_from_args(args)
        app = create_engine_app(config)
    except (ValueError, TypeError) as exc:
        print(f"kvroute engine: {exc}", file=sys.stderr)
        return 2
    from router.cli import run_server

    def started(url: str) -> None:
        events = "KV events off"
        if config.kv_events.enable_kv_cache_events and not config.zero_delay:
            src = resolved_source(config.kv_events, config.host)
            replay = src["replay_endpoint"] or "-"
            events = f"KV events {src['endpoint']} (topic {src['topic']!r}), replay {replay}"
        print(
            f"kvroute engine {config.engine_id}: listening on {url} (model {config.model}, block size "
            f"{config.block_size}); {events}; Ctrl-C stops",
            file=sys.stderr,
            flush=True,
        )

    # uvicorn turns SIGTERM/SIGINT into a graceful shutdown, which runs the lifespan's cleanup
    # (engine loop cancelled, ZMQ sockets closed).
    return run_server(
        app,
        prog="kvroute engine",
        host=config.host,
        port=config.port,
        on_started=started,
        log_level=args.log_level,
        lifespan="on",
    )


if __name__ == "__main__":
    raise SystemExit(main())
