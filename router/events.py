"""KV-event ingestion: decode vLLM's ZMQ frames and keep the prefix index in step with each engine.

Decoding is pure (``decode_payload`` / ``decode_events``, both wire layouts). ``EventManager`` owns
one SUB task per (engine, data-parallel rank): seq tracking, replay of gaps through a DEALER,
restart detection, reconnect with backoff, and per-source health for ``/ready`` and ``/debug``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from kvcore.index import PrefixIndex
from policies.base import Tier

log = logging.getLogger(__name__)

Hash = int | bytes


# --------------------------------------------------------------------------------- wire structs
# One struct per event serves both layouts: the map form is tagged by "type"; the array form
# (vLLM before mid-2026) is the array_like subclass whose first element is the type name.
# Every field after the first has a default so old arrays that stop early still decode, and
# unknown map keys / extra trailing array elements are ignored (msgspec's default).


class BlockStored(msgspec.Struct, tag_field="type", tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None = None
    token_ids: list[int] = msgspec.field(default_factory=list)
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[Any] | None = None


class BlockRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


class _ArrayBlockStored(BlockStored, array_like=True, tag="BlockStored"):
    pass


class _ArrayBlockRemoved(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _ArrayAllBlocksCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
_MapEvent = BlockStored | BlockRemoved | AllBlocksCleared
_ArrayEvent = _ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared


class _MapBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_MapEvent]
    data_parallel_rank: int | None = None


class _ArrayBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


@dataclass(slots=True)
class EventBatch:
    """One decoded batch (one engine scheduler step). ``skipped_events``: undecodable events."""

    ts: float
    events: list[KVEvent]
    dp_rank: int | None = None
    skipped_events: int = 0


_decode_map_batch = msgspec.msgpack.Decoder(_MapBatch).decode
_decode_array_batch = msgspec.msgpack.Decoder(_ArrayBatch).decode
_decode_raw_batch = msgspec.msgpack.Decoder(_RawBatch).decode


def decode_payload(payload: bytes) -> EventBatch:
    """Decode one msgpack batch payload, either layout, 2- or 3-element batch.

    Raises ValueError when the payload is not a batch at all; single undecodable events (e.g. an
    event type this router does not know) are skipped and counted in ``skipped_events``."""
    batch: _MapBatch | _ArrayBatch | _RawBatch
    try:
        batch = _decode_map_batch(payload)
    except msgspec.MsgspecError:
        try:
            batch = _decode_array_batch(payload)
        except msgspec.MsgspecError:
            try:
                batch = _decode_raw_batch(payload)
            except msgspec.MsgspecError as exc:
                raise ValueError(f"not a KV-event batch payload: {exc}") from None
            events, skipped = _convert_events(batch.events)
            return EventBatch(batch.ts, events, batch.data_parallel_rank, skipped)
    return EventBatch(batch.ts, list(batch.events), batch.data_parallel_rank)


def _convert_events(objs: Iterable[Any]) -> tuple[list[KVEvent], int]:
    events: list[KVEvent] = []
    skipped = 0
    for obj in objs:
        try:
            if isinstance(obj, Mapping):
                events.append(msgspec.convert(obj, _MapEvent))  # type: ignore[arg-type]
            elif isinstance(obj, list | tuple):
                events.append(msgspec.convert(list(obj), _ArrayEvent))  # type: ignore[arg-type]
            else:
                skipped += 1
        except msgspec.MsgspecError:
            skipped += 1
    return events, skipped


def decode_events(objs: Sequence[Any]) -> list[KVEvent]:
    """The same normalisation on already-decoded Python objects (map dicts or legacy arrays).

    Raises ValueError naming the first event that is not a known KV event."""
    events: list[KVEvent] = []
    for i, obj in enumerate(objs):
        converted, skipped = _convert_events([obj])
        if skipped:
            raise ValueError(f"event {i} is not a BlockStored/BlockRemoved/AllBlocksCleared: {obj!r:.200}")
        events.extend(converted)
    return events


# --------------------------------------------------------------------------------- sources

END_SEQ = 0xFFFFFFFFFFFFFFFF


@dataclass(frozen=True, slots=True)
class EventSource:
    """One publisher: an engine's data-parallel rank.

    ``bind``: True when the engine's publisher connects out (its endpoint names a host that is
    not ``*``), so this subscriber must bind. All ranks of an engine update the index entries of
    ``engine_id`` (a block counts as held when any rank holds it)."""

    engine_id: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    dp_rank: int = 0
    bind: bool = False

    @property
    def name(self) -> str:
        return f"{self.engine_id}/dp{self.dp_rank}"


def _publisher_binds(endpoint: str) -> bool:
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0]
    return host in ("*", "::", "[::]", "")


def _with_host(endpoint: str, host: str) -> str:
    scheme, rest = endpoint.split("://", 1)
    addr, port = rest.rsplit(":", 1)
    if addr in ("*", "::", "[::]", "", "0.0.0.0"):
        addr = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{scheme}://{addr}:{port}"


def sources_from_publisher_config(
    engine_id: str, engine_host: str, config_by_rank: Mapping[str, Mapping[str, Any]]
) -> list[EventSource]:
    """EventSources from an engine's ``GET /kv_event_sources`` body (keyed by rank as a string).

    A ``*`` host is replaced by ``engine_host``; a publisher that connects out (a concrete host)
    makes us bind at its endpoint. Raises ValueError on a body without endpoints."""
    sources = []
    for rank_text, cfg in sorted(config_by_rank.items(), key=lambda kv: int(kv[0])):
        endpoint = cfg.get("endpoint")
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise ValueError(
                f"engine {engine_id!r} rank {rank_text}: /kv_event_sources gave no usable endpoint "
                f"({endpoint!r}); configure the source explicitly"
            )
        publisher_binds = _publisher_binds(endpoint)
        if publisher_binds and not endpoint.startswith(("ipc://", "inproc://")):
            endpoint = _with_host(endpoint, engine_host)
        replay = cfg.get("replay_endpoint")
        if isinstance(replay, str) and replay.startswith("tcp://"):
            replay = _with_host(replay, engine_host)
        sources.append(
            EventSource(
                engine_id=engine_id,
                endpoint=endpoint,
                replay_endpoint=replay if isinstance(replay, str) and replay else None,
                topic=str(cfg.get("topic") or ""),
                dp_rank=int(rank_text),
                bind=not publisher_binds,
            )
        )
    return sources


async def discover_sources(session: Any, engine_id: str, engine_url: str) -> list[EventSource]:
    """Ask an engine (``aiohttp.ClientSession`` passed in) for its publishers."""
    url = engine_url.rstrip("/") + "/kv_event_sources"
    async with session.get(url) as resp:
        if resp.status != 200:
            raise ValueError(f"GET {url} answered {resp.status}; configure the engine's event source")
        body = await resp.json()
    host = urlsplit(engine_url).hostname or "127.0.0.1"
    return sources_from_publisher_config(engine_id, host, body)


# --------------------------------------------------------------------------------- health


@dataclass(slots=True)
class SourceHealth:
    """What one source's stream looks like; read by ``health()``."""

    source: EventSource
    connected: bool = False
    last_seq: int | None = None
    last_event_at: float | None = None  # monotonic
    last_event_ts: float | None = None  # engine's wall clock
    lag_s: float | None = None
    batches: int = 0
    events: int = 0
    gaps: int = 0
    missed_batches: int = 0
    replays: int = 0
    replayed_batches: int = 0
    replay_failures: int = 0
    restarts: int = 0
    clears: int = 0
    decode_errors: int = 0
    skipped_events: int = 0
    reconnects: int = 0
    #: True when batches were lost and could not be replayed (picture incomplete until reset).
    stale: bool = False
    last_error: str | None = None
    started_at: float = 0.0


@dataclass(slots=True)
class _Options:
    silent_after_s: float
    replay_timeout_s: float
    backoff_initial_s: float
    backoff_max_s: float


class EventManager:
    """Keeps ``index`` in step with every source's event stream.

    ``sources``: configured publishers. ``discover``: engine id -> base URL of engines whose
    publishers are found via ``GET /kv_event_sources`` (needs ``http_session``, an aiohttp
    ClientSession). Call ``await start()`` once and ``await stop()`` on shutdown."""

    def __init__(
        self,
        index: PrefixIndex,
        sources: Sequence[EventSource] = (),
        *,
        discover: Mapping[str, str] | None = None,
        http_session: Any = None,
        context: zmq.asyncio.Context | None = None,
        silent_after_s: float = 30.0,
        replay_timeout_s: float = 2.0,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        on_batch: Callable[[EventSource, EventBatch], None] | None = None,
    ) -> None:
        if discover and http_session is None:
            raise ValueError("EventManager: discover= needs http_session= (an aiohttp.ClientSession)")
        self._index = index
        self._sources = list(sources)
        self._discover = dict(discover or {})
        self._http_session = http_session
        self._own_context = context is None
        self._context = context
        self._opts = _Options(silent_after_s, replay_timeout_s, backoff_initial_s, backoff_max_s)
        self._clock = clock
        self._on_batch = on_batch
        self._health: dict[str, SourceHealth] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._discovery_errors: dict[str, str] = {}

    @property
    def index(self) -> PrefixIndex:
        return self._index

    async def start(self) -> None:
        """Start one task per source (and per engine to discover)."""
        if self._tasks:
            raise RuntimeError("EventManager.start() called twice")
        if self._context is None:
            self._context = zmq.asyncio.Context()
        for source in self._sources:
            self._start_source(source)
        for engine_id, url in self._discover.items():
            self._tasks.append(
                asyncio.create_task(self._discover_loop(engine_id, url), name=f"kv-discover:{engine_id}")
            )

    def _start_source(self, source: EventSource) -> None:
        if source.name in self._health:
            raise ValueError(f"event source {source.name} configured twice")
        health = SourceHealth(source, started_at=self._clock())
        self._health[source.name] = health
        self._index.add_engine(source.engine_id)
        self._tasks.append(asyncio.create_task(self._run_source(health), name=f"kv-events:{source.name}"))

    async def stop(self) -> None:
        """Cancel every task and close the sockets (and the ZMQ context if we made it)."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._own_context and self._context is not None:
            self._context.term()
            self._context = None

    async def _discover_loop(self, engine_id: str, url: str) -> None:
        delay = self._opts.backoff_initial_s
        while True:
            try:
                sources = await discover_sources(self._http_session, engine_id, url)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any discovery failure: retry, report in health
                self._discovery_errors[engine_id] = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._opts.backoff_max_s)
                continue
            self._discovery_errors.pop(engine_id, None)
            for source in sources:
                self._start_source(source)
            return

    # ----------------------------------------------------------------------------- per source

    async def _run_source(self, health: SourceHealth) -> None:
        source = health.source
        delay = self._opts.backoff_initial_s
        while True:
            sub = self._open_sub(source, health)
            if sub is None:
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._opts.backoff_max_s)
                health.reconnects += 1
                continue
            delay = self._opts.backoff_initial_s
            try:
                health.connected = True
                await self._receive_loop(sub, health)
            except (zmq.ZMQError, OSError) as exc:
                health.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("kv events %s: socket error %s; reconnecting", source.name, exc)
                health.reconnects += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._opts.backoff_max_s)
            finally:
                health.connected = False
                sub.close(linger=0)

    def _open_sub(self, source: EventSource, health: SourceHealth) -> zmq.asyncio.Socket | None:
        assert self._context is not None
        sub = self._context.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.RCVHWM, 100_000)
            # Native ZMQ reconnect with backoff covers a publisher that dies and comes back.
            sub.setsockopt(zmq.RECONNECT_IVL, max(1, int(self._opts.backoff_initial_s * 1000)))
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, int(self._opts.backoff_max_s * 1000)))
            sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
            if source.bind:
                sub.bind(source.endpoint)
            else:
                sub.connect(source.endpoint)
        except zmq.ZMQError as exc:
            health.last_error = f"cannot {'bind' if source.bind else 'connect'} {source.endpoint}: {exc}"
            log.warning("kv events %s: %s", source.name, health.last_error)
            sub.close(linger=0)
            return None
        return sub

    async def _receive_loop(self, sub: zmq.asyncio.Socket, health: SourceHealth) -> None:
        while True:
            frames = await sub.recv_multipart()
            parsed = self._parse_live(frames, health)
            if parsed is None:
                continue
            seq, payload = parsed
            await self._handle(health, seq, payload)

    def _parse_live(self, frames: list[bytes], health: SourceHealth) -> tuple[int, bytes] | None:
        if len(frames) == 3:
            _topic, seq_bytes, payload = frames
        elif len(frames) == 2:  # publisher without a topic frame
            seq_bytes, payload = frames
        else:
            health.decode_errors += 1
            return None
        if len(seq_bytes) != 8:
            health.decode_errors += 1
            return None
        return int.from_bytes(seq_bytes, "big"), payload

    async def _handle(self, health: SourceHealth, seq: int, payload: bytes) -> None:
        last = health.last_seq
        if last is not None and seq <= last:
            self._engine_restarted(health, seq)
            last = None
        if last is not None and seq > last + 1:
            health.gaps += 1
            await self._replay(health, last + 1, seq)
        elif last is None and seq > 0 and health.source.replay_endpoint:
            # Joined late (router or engine restart): fetch what the publisher still buffers.
            await self._replay(health, 0, seq, joined_late=True)
        self._apply(health, seq, payload)

    def _engine_restarted(self, health: SourceHealth, seq: int) -> None:
        source = health.source
        log.warning(
            "kv events %s: seq went back from %s to %s: engine restarted, dropping its GPU/CPU entries",
            source.name,
            health.last_seq,
            seq,
        )
        health.restarts += 1
        health.stale = False
        health.last_seq = None
        self._index.clear_engine(source.engine_id, (Tier.GPU, Tier.CPU))

    def _apply(self, health: SourceHealth, seq: int, payload: bytes) -> bool:
        health.last_seq = seq
        try:
            batch = decode_payload(payload)
        except ValueError as exc:
            health.decode_errors += 1
            health.last_error = str(exc)[:300]
            return False
        now = self._clock()
        health.batches += 1
        health.events += len(batch.events)
        health.skipped_events += batch.skipped_events
        health.last_event_at = now
        health.last_event_ts = batch.ts
        health.lag_s = max(0.0, time.time() - batch.ts)
        if any(type(e) in (AllBlocksCleared, _ArrayAllBlocksCleared) for e in batch.events):
            health.clears += 1
            health.stale = False
        self._index.apply_batch(health.source.engine_id, batch.events, now)
        if self._on_batch is not None:
            self._on_batch(health.source, batch)
        return True

    async def _replay(
        self, health: SourceHealth, start_seq: int, stop_seq: int, *, joined_late: bool = False
    ) -> None:
        """Fetch batches [start_seq, stop_seq) through the DEALER and apply them in order."""
        source = health.source
        missed = stop_seq - start_seq
        if not joined_late:
            health.missed_batches += missed
        if not source.replay_endpoint:
            if not joined_late:
                health.stale = True
                health.replay_failures += 1
            return
        assert self._context is not None
        health.replays += 1
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        expected = start_seq
        try:
            dealer.connect(source.replay_endpoint)
            await dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self._opts.replay_timeout_s
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0 or not await dealer.poll(int(remaining * 1000) + 1):
                    raise TimeoutError(f"replay from {source.replay_endpoint} timed out")
                frames = await dealer.recv_multipart()
                if len(frames) == 4:  # [b"", topic, seq, payload]
                    seq_bytes, payload = frames[2], frames[3]
                elif len(frames) == 3:  # older vLLM: [b"", seq, payload]
                    seq_bytes, payload = frames[1], frames[2]
                else:
                    health.decode_errors += 1
                    continue
                if len(seq_bytes) != 8:
                    health.decode_errors += 1
                    continue
                seq = int.from_bytes(seq_bytes, "big")
                if seq == END_SEQ:
                    break
                if seq < expected:
                    continue
                if seq >= stop_seq:
                    continue  # arrives live too
                if seq > expected and not (joined_late and expected == start_seq):
                    # The publisher's buffer no longer reaches back this far.
                    health.stale = True
                self._apply(health, seq, payload)
                health.replayed_batches += 1
                expected = seq + 1
        except (TimeoutError, zmq.ZMQError) as exc:
            health.replay_failures += 1
            health.last_error = f"replay failed: {exc}"
            log.warning("kv events %s: %s", source.name, health.last_error)
        finally:
            dealer.close(linger=0)
        if expected < stop_seq and not joined_late:
            health.stale = True

    # ----------------------------------------------------------------------------- health

    def source_health(self) -> dict[str, SourceHealth]:
        return dict(self._health)

    def health(self) -> dict[str, Any]:
        """A JSON-ready snapshot: per source, stream position and problems; "silent" when no
        event for ``silent_after_s`` (the app combines it with traffic to flag a missing publisher)."""
        now = self._clock()
        sources: dict[str, Any] = {}
        for name, h in self._health.items():
            since = now - (h.last_event_at if h.last_event_at is not None else h.started_at)
            silent = since > self._opts.silent_after_s
            if h.stale:
                status = "stale"
            elif not h.connected:
                status = "disconnected"
            elif silent:
                status = "silent"
            else:
                status = "ok"
            sources[name] = {
                "engine_id": h.source.engine_id,
                "dp_rank": h.source.dp_rank,
                "endpoint": h.source.endpoint,
                "status": status,
                "connected": h.connected,
                "silent": silent,
                "stale": h.stale,
                "last_seq": h.last_seq,
                "seconds_since_last_event": None
                if h.last_event_at is None
                else round(now - h.last_event_at, 3),
                "lag_s": None if h.lag_s is None else round(h.lag_s, 3),
                "batches": h.batches,
                "events": h.events,
                "gaps": h.gaps,
                "missed_batches": h.missed_batches,
                "replays": h.replays,
                "replayed_batches": h.replayed_batches,
                "replay_failures": h.replay_failures,
                "restarts": h.restarts,
                "clears": h.clears,
                "decode_errors": h.decode_errors,
                "skipped_events": h.skipped_events,
                "reconnects": h.reconnects,
                "last_error": h.last_error,
            }
        return {"sources": sources, "discovery_errors": dict(self._discovery_errors)}

    def untrusted_engines(self) -> set[str]:
        """Engines whose picture is known incomplete (EngineView.index_trusted=False)."""
        return {h.source.engine_id for h in self._health.values() if h.stale}


# --------------------------------------------------------------------------------- payloads


def debug_index_payload(index: PrefixIndex, manager: EventManager | None = None) -> dict[str, Any]:
    """Body of ``GET /debug/index``: counts per engine and tier, pools, source health."""
    body: dict[str, Any] = {"index": index.stats()}
    if manager is not None:
        body["events"] = manager.health()
    return body


def explain_payload(
    request: Any, fleet: Any, decision: Any, policy_name: str | None = None
) -> dict[str, Any]:
    """Body of ``POST /v1/route/explain`` from a RouteRequest (with prefix_matches filled), the
    FleetView and the policy's Decision: per engine prefix blocks per tier, load, scores, choice."""
    engines = []
    for view in fleet.engines:
        m = request.prefix_matches.get(view.engine_id)
        by_tier = m.blocks_by_tier if m is not None else (0, 0, 0)
        engines.append(
            {
                "engine_id": view.engine_id,
                "prefix_blocks": by_tier[0] + by_tier[1] + by_tier[2],
                "prefix_blocks_by_tier": {"gpu": by_tier[0], "cpu": by_tier[1], "storage": by_tier[2]},
                "prefix_tokens": (by_tier[0] + by_tier[1] + by_tier[2]) * request.block_size,
                "in_flight": view.in_flight,
                "queued_prefill_tokens": view.queued_prefill_tokens,
                "num_requests_running": view.num_requests_running,
                "num_requests_waiting": view.num_requests_waiting,
                "kv_cache_usage": view.kv_cache_usage,
                "index_trusted": view.index_trusted,
                "scores": decision.scores.get(view.engine_id, {}),
                "chosen": view.engine_id == decision.engine_id,
            }
        )
    return {
        "request_id": request.request_id,
        "policy": policy_name or decision.policy,
        "prompt_tokens": request.prompt_tokens,
        "prompt_blocks": len(request.block_keys),
        "block_size": request.block_size,
        "choice": decision.engine_id,
        "reason": decision.reason,
        "fallbacks": list(decision.fallbacks),
        "engines": engines,
    }
