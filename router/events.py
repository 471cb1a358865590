"""KV-event ingestion: keep the prefix index in step with each engine's vLLM ZMQ event stream.

``EventManager`` owns one supervised task per (engine, data-parallel rank): SUB socket (connect, or
bind for publishers that connect out), replay through a DEALER on every (re)connect, on gaps and as
an idle probe (vLLM sends no heartbeat), restart detection by seq and by the replay answer, fair
sharing of the event loop under bursts, rate limits on resyncs, and per-source health for
``/ready``, ``/debug/index`` and ``/metrics``.

Trust: a source's picture is trusted only on evidence, and every change says why (``trust_reason``
and ``trust_log`` in ``health()``): a replay answer that reaches back to the engine's first batch
(or continues what was applied), a first live batch at seq 0, an AllBlocksCleared, or - when the
history before the replay buffer is unknown - the engine's reported cached tokens agreeing with the
index over ``trust_evidence_requests`` requests. It is withdrawn on lost batches, a failed or
short replay, a GPU store of another block size, or a publisher absent past ``peer_grace_s``.
The wire format itself (structs, decoding, endpoint rules) is ``kvcore.wire``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import xxhash
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvcore.index import PrefixIndex
from kvcore.wire import (
    CLEARED_TYPES,
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    decode_events,
    decode_payload,
    offset_endpoint_port,
    parse_live_frames,
    parse_replay_frames,
    publisher_binds,
    replay_request,
    split_tcp,
    with_host,
)
from policies.base import Tier

log = logging.getLogger(__name__)

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventManager",
    "EventSource",
    "KVEvent",
    "SourceHealth",
    "decode_events",
    "decode_payload",
    "discover_sources",
    "sources_for_engine",
    "sources_from_publisher_config",
]

_digest = xxhash.xxh3_64_intdigest
#: Digests of this many recently applied batches are kept per source: a live frame whose seq was
#: already applied is a duplicate (same bytes, e.g. after a replay overlap) or a new incarnation.
_DIGESTS_KEPT = 20_000
#: vLLM's seq is a signed 64-bit counter (-1, i.e. 2**64-1 unsigned, marks the end of a replay):
#: a frame with a seq at or above 2**63 is malformed, whatever its payload.
_SEQ_LIMIT = 1 << 63
#: Trust changes kept per source for ``health()``.
_TRUST_LOG_KEPT = 8


# --------------------------------------------------------------------------------- sources


@dataclass(frozen=True, slots=True)
class EventSource:
    """One publisher: an engine's data-parallel rank.

    ``bind``: True when the engine's publisher connects out (vLLM's rule: its endpoint has no
    wildcard), so this subscriber must bind there. All ranks of an engine update the index entries
    of ``engine_id`` (a block counts as held when any rank holds it)."""

    engine_id: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    dp_rank: int = 0
    bind: bool = False

    @property
    def name(self) -> str:
        return f"{self.engine_id}/dp{self.dp_rank}"


_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def _same_host(a: str, b: str) -> bool:
    a, b = a.strip("[]").lower(), b.strip("[]").lower()
    return a == b or (a in _LOOPBACK and b in _LOOPBACK)


def sources_for_engine(
    engine_id: str,
    engine_host: str,
    endpoint: str,
    replay_endpoint: str | None = None,
    *,
    topic: str = "",
    data_parallel_size: int = 1,
    bind: bool | None = None,
) -> list[EventSource]:
    """The sources of one engine from its publisher endpoints as configured in vLLM (rank 0).

    Rank r uses port + r on both endpoints (vLLM's offset). ``bind`` None applies vLLM's rule: a
    publisher that binds (wildcard, ``::``, ipc) is connected to, its wildcard host replaced by
    ``engine_host``; a publisher with a concrete host connects out and we bind - unless that host
    is the engine's own host, which is how a server reports a wildcard it resolved itself (the
    simulator and ``GET /kv_event_sources`` do). ``bind`` True/False forces the mode."""
    if data_parallel_size < 1:
        raise ValueError(f"engine {engine_id!r}: data_parallel_size must be >= 1, got {data_parallel_size}")
    sources = []
    for rank in range(data_parallel_size):
        ep = offset_endpoint_port(endpoint, rank)
        if bind is None:
            parts = split_tcp(ep)
            we_bind = not publisher_binds(ep) and not (
                parts is not None and _same_host(parts[0], engine_host)
            )
        else:
            we_bind = bind
        if not we_bind:
            ep = with_host(ep, engine_host)
        replay = offset_endpoint_port(replay_endpoint, rank) if replay_endpoint else None
        if replay:
            replay = with_host(replay, engine_host)  # the replay ROUTER always binds on the engine
        sources.append(EventSource(engine_id, ep, replay, topic=topic, dp_rank=rank, bind=we_bind))
    return sources


def sources_from_publisher_config(
    engine_id: str, engine_host: str, config_by_rank: Mapping[str, Mapping[str, Any]]
) -> list[EventSource]:
    """EventSources from an engine's ``GET /kv_event_sources`` body (keyed by rank as a string;
    each rank's endpoints are already offset). Raises ValueError on a body without endpoints."""
    sources = []
    for rank_text, cfg in sorted(config_by_rank.items(), key=lambda kv: int(kv[0])):
        endpoint = cfg.get("endpoint")
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise ValueError(
                f"engine {engine_id!r} rank {rank_text}: /kv_event_sources gave no usable endpoint "
                f"({endpoint!r}); configure the source explicitly"
            )
        replay = cfg.get("replay_endpoint")
        (source,) = sources_for_engine(
            engine_id,
            engine_host,
            endpoint,
            replay if isinstance(replay, str) and replay else None,
            topic=str(cfg.get("topic") or ""),
        )
        sources.append(
            EventSource(
                engine_id, source.endpoint, source.replay_endpoint, source.topic, int(rank_text), source.bind
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
    #: The SUB socket is open (connected or bound).
    connected: bool = False
    #: A publisher completed the ZMQ handshake and has not disconnected since.
    peer_connected: bool = False
    last_seq: int | None = None
    last_event_at: float | None = None  # monotonic
    last_event_ts: float | None = None  # engine's wall clock
    lag_s: float | None = None
    batches: int = 0
    events: int = 0
    gaps: int = 0
    #: Batches lost (seq gaps), replayed or not: drops of a full backlog show up here.
    missed_batches: int = 0
    replays: int = 0
    replayed_batches: int = 0
    replay_failures: int = 0
    #: Seconds the last complete replay took, and how many batches it brought.
    last_replay_s: float | None = None
    last_replay_batches: int = 0
    restarts: int = 0
    clears: int = 0
    decode_errors: int = 0
    apply_errors: int = 0
    skipped_events: int = 0
    duplicates: int = 0
    seq_regressions: int = 0
    #: Resyncs wanted but held back by the rate limit (fault: regressing seqs amplified work).
    resyncs_deferred: int = 0
    reconnects: int = 0
    peer_connects: int = 0
    #: The source's task died on an unexpected error and was restarted.
    task_restarts: int = 0
    #: Idle probes sent (replay from last_seq + 1 while no batch arrives) and batches they found.
    probes: int = 0
    probe_batches: int = 0
    #: True when the picture is untrusted (lost batches, replay short, failed or still awaited).
    stale: bool = False
    stale_reason: str | None = None
    #: Why the picture is trusted now (None: nothing has been proven either way yet).
    trusted_reason: str | None = None
    #: The stale state is one the engine's delivered cached tokens can clear (unknown history).
    evidence_clears: bool = False
    #: The stale state is one a replay answer continuing the applied batches clears (no hole).
    resumable: bool = False
    #: A complete replay answer has arrived since the start (always True without replay endpoint).
    synced: bool = True
    #: Clock time since which no publisher is connected (None while one is).
    peer_lost_at: float | None = None
    last_error: str | None = None
    started_at: float = 0.0
    # -- private bookkeeping (not in health()) --
    clock: Callable[[], float] = time.monotonic
    trust_log: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=_TRUST_LOG_KEPT))
    last_probe_at: float | None = None
    pending_resync: str | None = None
    resync_restart: bool = False
    digests: OrderedDict[int, int] = field(default_factory=OrderedDict)
    #: Seqs applied from a replay answer (recent ones): a live copy arriving later makes the batch a
    #: duplicate, not a replayed one, so the count does not depend on which copy came first.
    replayed_seqs: OrderedDict[int, None] = field(default_factory=OrderedDict)
    tokens: float = 0.0
    tokens_at: float = 0.0
    #: After failed replays, none before this clock time (doubling up to a minute): a dead
    #: replay socket must not stall the live stream for replay_timeout_s again and again.
    replay_not_before: float = 0.0
    replay_failures_in_row: int = 0
    logged: dict[str, float] = field(default_factory=dict)

    def mark_stale(self, reason: str, *, evidence_clears: bool = False, resumable: bool = False) -> None:
        """Untrust the picture. ``evidence_clears``: the engine's delivered cached tokens may prove
        it right again (blocks of unknown history); otherwise only a replay or a restart can.
        ``resumable``: what was applied has no hole, so an answer continuing it completes it."""
        if not self.stale:
            log.warning("kv events %s: index of this engine is now untrusted: %s", self.source.name, reason)
            self.trust_log.append({"at_s": round(self.clock(), 3), "trusted": False, "reason": reason})
        elif reason != self.stale_reason:
            self.trust_log.append({"at_s": round(self.clock(), 3), "trusted": False, "reason": reason})
        self.stale = True
        self.stale_reason = reason
        self.evidence_clears = evidence_clears
        self.resumable = resumable
        self.trusted_reason = None

    def trust(self, reason: str) -> None:
        """Trust the picture on the evidence named by ``reason``."""
        if self.stale:
            log.info("kv events %s: index of this engine is trusted again: %s", self.source.name, reason)
            self.trust_log.append({"at_s": round(self.clock(), 3), "trusted": True, "reason": reason})
        self.stale = False
        self.stale_reason = None
        self.evidence_clears = False
        self.resumable = False
        self.trusted_reason = reason


@dataclass(slots=True)
class _Options:
    silent_after_s: float
    replay_timeout_s: float
    backoff_initial_s: float
    backoff_max_s: float
    rcvhwm: int
    slice_s: float
    resync_burst: int
    resync_per_s: float
    replay_connect_timeout_s: float
    probe_idle_s: float
    peer_grace_s: float
    trust_evidence_requests: int
    trust_evidence_agree: float


@dataclass(slots=True)
class _ReplayResult:
    complete: bool = False
    #: First seq in the answer (None: the buffer held nothing from the asked seq on).
    first: int | None = None
    applied: int = 0
    #: Applied onto an empty picture (fresh join, or a new incarnation found in the answer).
    fresh: bool = False
    #: Batches missing between two consecutive seqs of the answer.
    holes: int = 0
    #: Why the answer is incomplete (timeout, socket error, holes).
    error: str = ""


class EventManager:
    """Keeps ``index`` in step with every source's event stream.

    ``sources``: configured publishers. ``discover``: engine id -> base URL of engines whose
    publishers are found via ``GET /kv_event_sources`` (needs ``http_session``, an aiohttp
    ClientSession). Call ``await start()`` once and ``await stop()`` on shutdown.

    ``replay_timeout_s``: longest silence inside a replay answer (not its total length).
    ``rcvhwm``: bounded backlog per source (messages); beyond it ZMQ drops, seen as seq gaps.
    ``slice_s``: ingestion yields the event loop after this much work. ``resync_burst`` /
    ``resync_per_s``: token bucket for replays and restart handling per source.
    ``replay_connect_timeout_s``: a replay endpoint that accepts no connection this soon is given up
    (live batches wait at most this long for a dead one; later attempts back off).
    ``probe_idle_s``: after this long without a batch, ask the replay endpoint for batches after
    the last applied seq (at most once per ``probe_idle_s``): a lost tail is noticed while idle.
    ``peer_grace_s``: a source whose publisher has not been connected for this long is reported
    disconnected and untrusted. ``block_sizes``: engine id -> configured block size; a GPU store
    of another size untrusts the engine. ``trust_evidence_requests`` / ``trust_evidence_agree``:
    an engine untrusted for unknown history is trusted again once its delivered cached tokens
    agreed with the index on this fraction of this many requests. ``clock``: monotonic seconds of
    every timing rule (injectable for tests)."""

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
        backoff_max_s: float = 1.0,
        rcvhwm: int = 10_000,
        slice_s: float = 0.0005,
        resync_burst: int = 4,
        resync_per_s: float = 0.5,
        replay_connect_timeout_s: float = 0.5,
        probe_idle_s: float = 5.0,
        peer_grace_s: float = 10.0,
        block_sizes: Mapping[str, int] | None = None,
        trust_evidence_requests: int = 32,
        trust_evidence_agree: float = 0.9,
        clock: Callable[[], float] = time.monotonic,
        on_batch: Callable[[EventSource, EventBatch], None] | None = None,
    ) -> None:
        if discover and http_session is None:
            raise ValueError("EventManager: discover= needs http_session= (an aiohttp.ClientSession)")
        if trust_evidence_requests < 1 or not 0 < trust_evidence_agree <= 1:
            raise ValueError(
                "EventManager: trust_evidence_requests must be >= 1 and trust_evidence_agree in (0, 1], "
                f"got {trust_evidence_requests} and {trust_evidence_agree}"
            )
        if replay_connect_timeout_s <= 0 or probe_idle_s <= 0 or peer_grace_s < 0:
            raise ValueError(
                "EventManager: replay_connect_timeout_s and probe_idle_s must be positive, peer_grace_s >= 0"
            )
        self._index = index
        self._sources = list(sources)
        self._discover = dict(discover or {})
        self._http_session = http_session
        self._own_context = context is None
        self._context = context
        self._opts = _Options(
            silent_after_s,
            replay_timeout_s,
            backoff_initial_s,
            backoff_max_s,
            rcvhwm,
            slice_s,
            resync_burst,
            resync_per_s,
            replay_connect_timeout_s,
            probe_idle_s,
            peer_grace_s,
            trust_evidence_requests,
            trust_evidence_agree,
        )
        self._block_sizes = dict(block_sizes or {})
        self._clock = clock
        self._on_batch = on_batch
        self._health: dict[str, SourceHealth] = {}
        #: ``_health``'s entries by engine id (``trusts``).
        self._by_engine: dict[str, list[SourceHealth]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._discovery_errors: dict[str, str] = {}
        self._started = False

    @property
    def index(self) -> PrefixIndex:
        return self._index

    async def start(self) -> None:
        """Start one task per source (and per engine to discover)."""
        if self._started:
            raise RuntimeError("EventManager.start() called twice")
        self._started = True
        if self._context is None:
            self._context = zmq.asyncio.Context()
        for source in self._sources:
            self._start_source(source)
        for engine_id, url in self._discover.items():
            self._tasks.append(
                asyncio.create_task(self._discover_loop(engine_id, url), name=f"kv-discover:{engine_id}")
            )
        self._tasks.append(asyncio.create_task(self._evidence_loop(), name="kv-events-evidence"))

    def _start_source(self, source: EventSource) -> None:
        if source.name in self._health:
            raise ValueError(f"event source {source.name} configured twice")
        now = time.monotonic()
        started = self._clock()
        health = SourceHealth(
            source,
            started_at=started,
            peer_lost_at=started,
            clock=self._clock,
            tokens=float(self._opts.resync_burst),
            tokens_at=now,
        )
        self._health[source.name] = health
        self._by_engine.setdefault(source.engine_id, []).append(health)
        self._index.add_engine(source.engine_id)
        block_size = self._block_sizes.get(source.engine_id)
        if block_size is not None:
            self._index.set_block_size(source.engine_id, block_size)
        if source.replay_endpoint:
            # What the engine announced before we subscribed is unknown until its buffer answers.
            health.synced = False
            health.mark_stale("waiting for the first replay answer of the engine's buffer")
        self._tasks.append(asyncio.create_task(self._supervise(health), name=f"kv-events:{source.name}"))

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

    def _backoff(self, delay_s: float) -> float:
        """Next reconnect delay: doubling, capped at backoff_max_s, with +-20 % jitter so that many
        routers (or sources) that lost an engine together do not retry in lockstep."""
        return min(delay_s * 2, self._opts.backoff_max_s) * random.uniform(0.8, 1.2)

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
                delay = self._backoff(delay)
                continue
            self._discovery_errors.pop(engine_id, None)
            for source in sources:
                self._start_source(source)
            return

    def _log_limited(self, health: SourceHealth, key: str, level: int, msg: str, *args: Any) -> None:
        """Log ``msg`` the first time and then at most once a minute per (source, key)."""
        now = time.monotonic()
        last = health.logged.get(key)
        if last is None or now - last >= 60.0:
            health.logged[key] = now
            log.log(level, "kv events %s: " + msg, health.source.name, *args)

    def _take_resync_token(self, health: SourceHealth) -> bool:
        if self._clock() < health.replay_not_before:
            return False
        now = time.monotonic()
        health.tokens = min(
            float(self._opts.resync_burst),
            health.tokens + (now - health.tokens_at) * self._opts.resync_per_s,
        )
        health.tokens_at = now
        if health.tokens >= 1.0:
            health.tokens -= 1.0
            return True
        return False

    # ----------------------------------------------------------------------------- per source

    async def _supervise(self, health: SourceHealth) -> None:
        """Run the source; an unexpected error is counted, logged and the source restarted."""
        delay = self._opts.backoff_initial_s
        while True:
            try:
                await self._run_source(health)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                health.task_restarts += 1
                health.last_error = f"task crashed: {type(exc).__name__}: {exc}"[:300]
                if health.task_restarts == 1:
                    log.exception("kv events %s: ingestion task crashed; restarting it", health.source.name)
                else:
                    self._log_limited(health, "crash", logging.ERROR, "%s; restarting", health.last_error)
                self._peer_gone(health)
                health.connected = False
                await asyncio.sleep(delay)
                delay = self._backoff(delay)

    def _peer_gone(self, health: SourceHealth) -> None:
        if health.peer_connected or health.peer_lost_at is None:
            health.peer_lost_at = self._clock()
        health.peer_connected = False

    async def _run_source(self, health: SourceHealth) -> None:
        source = health.source
        delay = self._opts.backoff_initial_s
        while True:
            opened = self._open_sub(source, health)
            if opened is not None:
                break
            health.reconnects += 1
            await asyncio.sleep(delay)
            delay = self._backoff(delay)
        sub, monitor = opened
        try:
            health.connected = True
            await self._receive_loop(sub, zmq.Socket.shadow(monitor.underlying), health)
        finally:
            self._peer_gone(health)
            health.connected = False
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    def _open_sub(
        self, source: EventSource, health: SourceHealth
    ) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket] | None:
        assert self._context is not None
        sub = self._context.socket(zmq.SUB)
        # The monitor is attached before connect/bind: a fast handshake must not be missed (it
        # triggers the replay on connect).
        monitor = sub.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
        )
        try:
            sub.setsockopt(zmq.RCVHWM, self._opts.rcvhwm)
            # ZMQ's own reconnect covers a publisher that dies and comes back; cap it near 1 s
            # (a short-lived publisher must not be missed) and jitter it per socket.
            ivl_ms = max(1, int(self._opts.backoff_initial_s * 1000 * random.uniform(0.8, 1.2)))
            sub.setsockopt(zmq.RECONNECT_IVL, ivl_ms)
            sub.setsockopt(
                zmq.RECONNECT_IVL_MAX,
                max(ivl_ms, int(self._opts.backoff_max_s * 1000 * random.uniform(0.8, 1.0))),
            )
            sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
            if source.bind:
                sub.bind(source.endpoint)
            else:
                sub.connect(source.endpoint)
        except zmq.ZMQError as exc:
            health.last_error = f"cannot {'bind' if source.bind else 'connect'} {source.endpoint}: {exc}"
            self._log_limited(health, "open", logging.WARNING, "%s", health.last_error)
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            return None
        return sub, monitor

    def _poll_monitor(self, monitor: zmq.Socket, health: SourceHealth) -> None:
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                health.peer_connected = True
                health.peer_lost_at = None
                health.peer_connects += 1
                if health.source.replay_endpoint:
                    # First connect: fetch what the engine announced before we listened. Reconnect:
                    # the replay answer also tells whether the engine restarted meanwhile.
                    why = "first connect" if health.peer_connects == 1 else "reconnect"
                    health.pending_resync = health.pending_resync or why
            elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                if health.peer_connected:
                    health.peer_lost_at = self._clock()
                health.peer_connected = False
                health.reconnects += 1

    async def _receive_loop(self, sub: zmq.asyncio.Socket, monitor: zmq.Socket, health: SourceHealth) -> None:
        loop = asyncio.get_running_loop()
        raw: zmq.Socket[Any] = zmq.Socket.shadow(sub.underlying)
        while True:
            self._poll_monitor(monitor, health)
            if health.pending_resync is not None and self._take_resync_token(health):
                await self._resync(health)
                continue
            if not await sub.poll(100):
                if self.probe_due(health):
                    await self._probe(health)
                continue
            # Drain what is queued, but yield the loop every slice_s: awaiting recv on a socket
            # with queued messages returns a finished future and would never yield (bursts froze
            # /health and every stream).
            slice_end = loop.time() + self._opts.slice_s
            while True:
                try:
                    frames = raw.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                gap = self._on_live(health, frames)
                if gap is not None:
                    await self._fill_gap(health, *gap)
                if loop.time() >= slice_end:
                    await asyncio.sleep(0)
                    self._poll_monitor(monitor, health)
                    if health.pending_resync is not None:
                        break
                    slice_end = loop.time() + self._opts.slice_s

    # ----------------------------------------------------------------------------- live frames

    def _on_live(
        self, health: SourceHealth, frames: list[bytes]
    ) -> tuple[int, int, bytes, EventBatch] | None:
        """Handle one live message. Returns (first missing seq, seq, payload, batch) when batches
        before this one must be replayed before it is applied."""
        parsed = parse_live_frames(frames)
        if parsed is None:
            health.decode_errors += 1
            self._log_limited(health, "frames", logging.WARNING, "malformed message (%d frames)", len(frames))
            return None
        seq, payload = parsed
        if seq >= _SEQ_LIMIT:
            health.decode_errors += 1
            health.last_error = f"live frame with seq {seq}: not a vLLM seq (signed 64-bit counter)"
            self._log_limited(health, "seq", logging.WARNING, "%s", health.last_error)
            return None
        batch = self._decode(health, payload)
        if batch is None:
            return None  # an undecodable frame says nothing about the stream: seq untouched
        last = health.last_seq
        if last is not None and seq <= last:
            if health.digests.get(seq) == _digest(payload):
                health.duplicates += 1  # the same batch again (replay and live overlapped)
                if health.replayed_seqs.pop(seq, 0) is None:
                    health.replayed_batches -= 1  # it was not lost: its live copy arrived too
                return None
            health.seq_regressions += 1
            if not self._take_resync_token(health):
                # Rate limited: follow the new stream, resync (clear + replay) when allowed. The
                # old incarnation's entries are dropped at once, but once per deferred resync, not
                # per regressing frame (a stream of them must not clear the engine each time).
                health.resyncs_deferred += 1
                if health.pending_resync != "seq regression":
                    self._engine_restarted(health)
                self._log_limited(
                    health, "regress", logging.WARNING, "seq went back (%s -> %s); resync deferred", last, seq
                )
                health.mark_stale("seq regressions faster than the resync limit")
                health.pending_resync = "seq regression"
                health.resync_restart = True
                self._apply(health, seq, payload, batch)
                return None
            self._log_limited(
                health,
                "restart",
                logging.WARNING,
                "seq went back from %s to %s: engine restarted, dropping its GPU/CPU entries",
                last,
                seq,
            )
            self._engine_restarted(health)
            if seq > 0 and health.source.replay_endpoint:
                health.mark_stale(
                    f"engine restarted (seq went back from {last} to {seq}); rebuilding from its replay "
                    "buffer"
                )
            last = None
        if last is None:
            if seq == 0:
                # The incarnation's first batch, live, onto an empty picture: nothing came before.
                health.synced = True
                if not health.stale:
                    health.trusted_reason = "following the engine from its first batch (seq 0)"
                elif not health.pending_resync:
                    health.trust("following the engine from its first live batch (seq 0)")
            if seq > 0 and health.source.replay_endpoint:
                return (0, seq, payload, batch)
            if seq > 0:
                self._mark_unknown_history(
                    health, f"joined at seq {seq} without a replay endpoint: earlier blocks unknown"
                )
            self._apply(health, seq, payload, batch)
        elif seq == last + 1:
            self._apply(health, seq, payload, batch)
        else:
            health.gaps += 1
            health.missed_batches += seq - last - 1
            return (last + 1, seq, payload, batch)
        return None

    def _decode(self, health: SourceHealth, payload: bytes) -> EventBatch | None:
        try:
            return decode_payload(payload)
        except Exception as exc:  # ValueError, and anything a hostile payload might raise
            health.decode_errors += 1
            health.last_error = f"undecodable payload: {exc}"[:300]
            self._log_limited(health, "decode", logging.WARNING, "%s", health.last_error)
            return None

    def _engine_restarted(self, health: SourceHealth) -> None:
        """Evidence of a new incarnation (seq went back, or the replay answer does not continue
        what was applied): count it and drop the engine's GPU/CPU entries. Trust comes back only
        with the new incarnation's picture (its seq 0, or a replay answer reaching back to it)."""
        health.restarts += 1
        self._clear_picture(health)

    def _clear_picture(self, health: SourceHealth) -> None:
        """Forget what the engine announced in GPU/CPU, to rebuild it from a replay or seq 0."""
        health.last_seq = None
        health.digests.clear()
        health.replayed_seqs.clear()
        self._index.clear_engine(health.source.engine_id, (Tier.GPU, Tier.CPU))
        # Other ranks of the engine shared those entries: they must re-announce theirs.
        for other in self._health.values():
            if other is not health and other.source.engine_id == health.source.engine_id:
                other.pending_resync = other.pending_resync or "another rank of the engine restarted"
                other.resync_restart = True

    def _apply(self, health: SourceHealth, seq: int, payload: bytes, batch: EventBatch) -> None:
        health.last_seq = seq
        digests = health.digests
        digests[seq] = _digest(payload)
        if len(digests) > _DIGESTS_KEPT:
            digests.popitem(last=False)
        now = self._clock()
        health.batches += 1
        health.events += len(batch.events)
        health.skipped_events += batch.skipped_events
        health.last_event_at = now
        health.last_event_ts = batch.ts
        health.lag_s = max(0.0, time.time() - batch.ts)
        if any(type(e) in CLEARED_TYPES for e in batch.events):
            health.clears += 1
            health.trust(f"AllBlocksCleared in batch {seq}: the engine dropped its GPU cache")
        engine_id = health.source.engine_id
        mismatched = self._index.gpu_block_size_mismatches(engine_id)
        try:
            self._index.apply_batch(engine_id, batch.events, now)
        except Exception as exc:  # a batch the index cannot take must not end ingestion
            health.apply_errors += 1
            health.last_error = f"index rejected batch {seq}: {type(exc).__name__}: {exc}"[:300]
            self._log_limited(health, "apply", logging.ERROR, "%s", health.last_error)
            health.mark_stale(f"batch {seq} could not be applied")
        if self._index.gpu_block_size_mismatches(engine_id) != mismatched:
            expected = self._block_sizes.get(engine_id)
            sizes = sorted({e.block_size for e in batch.events if getattr(e, "token_ids", None)} - {expected})
            health.mark_stale(
                f"batch {seq} stores GPU blocks of block_size {sizes} but the engine is configured "
                f"with block_size {expected}: its blocks cannot match the router's keys (fix "
                "engines[].block_size or the engine's --block-size)"
            )
        if self._on_batch is not None:
            self._on_batch(health.source, batch)

    # ----------------------------------------------------------------------------- replay

    async def _fill_gap(
        self, health: SourceHealth, start: int, seq: int, payload: bytes, batch: EventBatch
    ) -> None:
        """Replay [start, seq) then apply the live batch ``seq``; without replay: mark stale."""
        joined = health.last_seq is None
        if not health.source.replay_endpoint:
            health.replay_failures += 1
            self._mark_unknown_history(
                health, f"lost batches {start}..{seq - 1} and the engine has no replay endpoint"
            )
            self._apply(health, seq, payload, batch)
            return
        if joined:
            # A fresh picture: this replay is the (re)connect resync.
            if not health.resync_restart:
                health.pending_resync = None
        elif not self._take_resync_token(health):
            health.resyncs_deferred += 1
            self._mark_unknown_history(
                health, f"lost batches {start}..{seq - 1}; replay held back by the rate limit"
            )
            health.pending_resync = health.pending_resync or "gap"
            health.resync_restart = True
            self._apply(health, seq, payload, batch)
            return
        result = await self._replay(health, start, stop_seq=seq)
        if not result.complete:
            health.replay_failures += 1
            self._mark_unknown_history(
                health, f"replay of batches {start}..{seq - 1} failed or was incomplete ({result.error})"
            )
            health.pending_resync = "catch up after a failed replay"
            health.resync_restart = True
        elif result.first is None or result.first > start:
            if not joined:
                health.replay_failures += 1
            reached = "nothing" if result.first is None else f"seq {result.first}"
            self._mark_unknown_history(
                health, f"replay buffer does not reach back to seq {start} (starts at {reached})"
            )
            health.synced = True
        else:
            self._answered(health, result, f"batches {start}..{seq - 1}")
        if health.last_seq is None or seq > health.last_seq:
            self._apply(health, seq, payload, batch)

    def _answered(self, health: SourceHealth, result: _ReplayResult, what: str) -> None:
        """A complete replay answer that lacked nothing: trust follows when it rebuilt the picture
        from the engine's first batch, or when it was the answer the start was waiting for."""
        if result.fresh and result.first in (None, 0):
            health.trust("rebuilt from a replay answer that reaches back to the engine's first batch")
        elif health.stale and (health.resumable or not (health.synced or health.evidence_clears)):
            health.trust(f"a complete replay answer ({what}) continued the applied batches: nothing missing")
        health.synced = True

    def _mark_unknown_history(
        self, health: SourceHealth, reason: str, *, resumable: bool = False, new_loss: bool = True
    ) -> None:
        """Untrust for blocks of unknown history, and start collecting the evidence that can clear
        it. ``new_loss`` False (a retry failed, nothing more was lost): evidence so far is kept."""
        health.mark_stale(reason, evidence_clears=True, resumable=resumable)
        self._index.watch_delivery(
            health.source.engine_id, self._opts.trust_evidence_requests, keep=not new_loss
        )

    async def _resync(self, health: SourceHealth) -> None:
        """Replay the whole buffer. After a restart or a failed catch-up (``resync_restart``) the
        engine's entries are rebuilt from the answer - dropped only once the answer begins, so a
        dead replay socket neither empties the picture nor counts as a restart. Otherwise the
        answer is checked against what was applied: a batch at our last seq with other bytes, or a
        buffer that ends below it, is a new incarnation (the engine restarted while we were not
        listening) and the engine is cleared then."""
        reason = health.pending_resync
        rebuild = health.resync_restart
        health.pending_resync = None
        health.resync_restart = False
        if not health.source.replay_endpoint:
            if rebuild:
                self._clear_picture(health)
                self._mark_unknown_history(
                    health, f"cleared after {reason}; no replay endpoint to rebuild from"
                )
            return
        log.info("kv events %s: replaying the publisher's buffer (%s)", health.source.name, reason)
        known_last = health.last_seq
        result = await self._replay(health, 0, stop_seq=None, rebuild=rebuild)
        if not result.complete:
            health.replay_failures += 1
            why = f"replay after {reason} failed or was incomplete ({result.error})"
            if not health.synced:
                why += "; still waiting for the first replay answer"
            # Without a rebuild the answer was applied in order: the retry's answer continues it.
            # A retry that fails loses nothing new: the evidence collected so far stands.
            self._mark_unknown_history(health, why, resumable=not rebuild, new_loss=False)
            health.pending_resync = reason  # try again when the rate limit allows
            health.resync_restart = rebuild
        elif result.fresh:
            if result.first not in (None, 0):
                self._mark_unknown_history(
                    health, f"replay buffer starts at seq {result.first}: blocks announced before are unknown"
                )
                health.synced = True
            else:
                self._answered(health, result, "the whole buffer")
        elif known_last is not None and result.first is not None and result.first > known_last + 1:
            health.missed_batches += result.first - known_last - 1
            self._mark_unknown_history(
                health, f"batches {known_last + 1}..{result.first - 1} lost: no longer in the buffer"
            )
            health.synced = True
        else:
            self._answered(health, result, "the whole buffer")

    def probe_due(self, health: SourceHealth) -> bool:
        """Whether to ask the replay endpoint for a tail we might have lost: the source has a
        replay endpoint and a picture, nothing is pending, no batch arrived for ``probe_idle_s``
        and no probe ran for as long (a dead endpoint also waits out its failure backoff)."""
        if not health.source.replay_endpoint or health.last_seq is None or health.pending_resync:
            return False
        now = self._clock()
        idle_s = self._opts.probe_idle_s
        quiet_since = health.last_event_at if health.last_event_at is not None else health.started_at
        if now - quiet_since < idle_s:
            return False
        if health.last_probe_at is not None and now - health.last_probe_at < idle_s:
            return False
        return now >= health.replay_not_before

    async def _probe(self, health: SourceHealth) -> None:
        """Ask for every batch after the last applied one (the answer is just our last batch and
        the end marker when nothing was lost); apply what comes back."""
        assert health.last_seq is not None
        health.probes += 1
        health.last_probe_at = self._clock()
        known_last = health.last_seq
        result = await self._replay(health, known_last + 1, stop_seq=None)
        if not result.complete:
            health.replay_failures += 1  # the endpoint did not answer: nothing learnt either way
            return
        if result.fresh:
            # The engine restarted while idle; the answer rebuilt its picture.
            if result.first in (None, 0):
                self._answered(health, result, "an idle probe")
            else:
                self._mark_unknown_history(
                    health, f"engine restarted while idle; its replay buffer starts at seq {result.first}"
                )
            return
        if result.applied:
            health.probe_batches += result.applied
            health.gaps += 1
            self._log_limited(
                health,
                "probe",
                logging.WARNING,
                "idle probe found %d batches after seq %d that never arrived live",
                result.applied,
                known_last,
            )
        if result.first is not None and result.first > known_last + 1:
            health.missed_batches += result.first - known_last - 1
            self._mark_unknown_history(
                health, f"batches {known_last + 1}..{result.first - 1} lost: no longer in the buffer"
            )
        elif result.applied:
            health.missed_batches += result.applied

    async def _replay(
        self, health: SourceHealth, start_seq: int, *, stop_seq: int | None, rebuild: bool = False
    ) -> _ReplayResult:
        """Ask the replay ROUTER for batches >= start_seq and apply them in order (below
        ``stop_seq`` if given). Times out per silence, not per replay, and yields the loop every
        slice. When we already hold a picture, the answer is checked against it first; with
        ``rebuild`` the picture is dropped as the answer begins and rebuilt from it."""
        source = health.source
        assert self._context is not None and source.replay_endpoint
        health.replays += 1
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        # Queue the request only on a completed connection: POLLOUT then says the endpoint is alive.
        dealer.setsockopt(zmq.IMMEDIATE, 1)
        loop = asyncio.get_running_loop()
        started = loop.time()
        result = _ReplayResult(fresh=health.last_seq is None)
        held: list[tuple[int, bytes, EventBatch]] = []  # batches <= our last seq, until verified
        known_last = None if rebuild else health.last_seq
        decided = known_last is None
        expected: int | None = None
        if known_last is not None:
            # Ask from our last applied seq: its bytes in the answer tell whether the publisher is
            # still the incarnation we followed (a restart is otherwise invisible when the new
            # seqs happen to run past ours).
            start_seq = min(start_seq, known_last)
        try:
            dealer.connect(source.replay_endpoint)
            connect_s = self._opts.replay_connect_timeout_s
            if not await dealer.poll(int(connect_s * 1000) + 1, zmq.POLLOUT):  # type: ignore[call-arg]
                raise TimeoutError(
                    f"replay endpoint {source.replay_endpoint} accepted no connection in {connect_s:g} s"
                )
            await dealer.send_multipart(replay_request(start_seq))
            slice_end = loop.time() + self._opts.slice_s
            raw: zmq.Socket[Any] = zmq.Socket.shadow(dealer.underlying)
            while True:
                # Drain without a future per message; wait (and time out) only on silence.
                try:
                    frames = raw.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    if not await dealer.poll(int(self._opts.replay_timeout_s * 1000) + 1):
                        raise TimeoutError(
                            f"replay from {source.replay_endpoint} silent for "
                            f"{self._opts.replay_timeout_s:g} s after {result.applied} batches"
                        ) from None
                    continue
                if rebuild:
                    # The endpoint answers: only now drop the picture the answer rebuilds.
                    rebuild = False
                    self._clear_picture(health)
                    result.fresh = True
                parsed = parse_replay_frames(frames)
                if parsed is None:
                    health.decode_errors += 1
                    continue
                seq, payload = parsed
                if seq == END_SEQ:
                    result.complete = True
                    break
                if seq >= _SEQ_LIMIT:
                    health.decode_errors += 1
                    continue
                if result.first is None:
                    result.first = seq
                elif expected is not None and seq != expected:
                    # A hole inside the answer (a ROUTER drops beyond its send high-water mark).
                    result.holes += abs(seq - expected)
                expected = seq + 1
                if stop_seq is not None and seq >= stop_seq:
                    continue  # arrives live too
                batch = self._decode(health, payload)
                if batch is None:
                    continue
                if not decided:
                    assert known_last is not None
                    if seq < known_last:
                        held.append((seq, payload, batch))
                        continue
                    decided = True
                    if seq == known_last and health.digests.get(seq) == _digest(payload):
                        held.clear()
                        continue  # same incarnation: everything up to here is applied already
                    # Here seq >= known_last. Other bytes at our last seq, or a buffer that skips
                    # it, is another incarnation; a buffer starting above it cannot tell.
                    if seq == known_last or held:
                        self._new_incarnation(health, known_last, seq)
                        result.fresh = True
                        for item in held:
                            self._apply_replayed(health, result, *item)
                        held.clear()
                elif health.last_seq is not None and seq <= health.last_seq:
                    continue
                self._apply_replayed(health, result, seq, payload, batch)
                if loop.time() >= slice_end:
                    await asyncio.sleep(0)
                    slice_end = loop.time() + self._opts.slice_s
        except (TimeoutError, zmq.ZMQError) as exc:
            result.error = str(exc)
            health.last_error = f"replay failed: {exc}"
            self._log_limited(health, "replay", logging.WARNING, "%s", health.last_error)
        finally:
            dealer.close(linger=0)
        if not decided and result.complete:
            # The whole buffer lies below our last seq (or is empty): a younger incarnation.
            assert known_last is not None
            self._new_incarnation(health, known_last, None)
            result.fresh = True
            for item in held:
                self._apply_replayed(health, result, *item)
        if result.complete and not result.holes:
            health.replay_failures_in_row = 0
        else:
            health.replay_failures_in_row += 1
            health.replay_not_before = self._clock() + min(60.0, 2.0**health.replay_failures_in_row)
        if result.holes:
            health.missed_batches += result.holes
            self._log_limited(
                health, "holes", logging.WARNING, "replay answer lacked %d batches", result.holes
            )
            result.complete = False
            result.error = f"the answer lacked {result.holes} batches"
        if result.complete:
            health.last_replay_s = loop.time() - started
            health.last_replay_batches = result.applied
        return result

    def _apply_replayed(
        self, health: SourceHealth, result: _ReplayResult, seq: int, payload: bytes, batch: EventBatch
    ) -> None:
        """Apply one batch of a replay answer; ``replayed_batches`` moves as the answer arrives."""
        self._apply(health, seq, payload, batch)
        result.applied += 1
        health.replayed_batches += 1
        replayed = health.replayed_seqs
        replayed[seq] = None
        if len(replayed) > _DIGESTS_KEPT:
            replayed.popitem(last=False)

    def _new_incarnation(self, health: SourceHealth, known_last: int, seen: int | None) -> None:
        self._log_limited(
            health,
            "incarnation",
            logging.WARNING,
            "the replay answer does not continue what was applied up to seq %s (at seq %s): the engine "
            "restarted while we were not listening; dropping its GPU/CPU entries",
            known_last,
            seen,
        )
        self._engine_restarted(health)

    # ----------------------------------------------------------------------------- evidence

    async def _evidence_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            self.check_evidence()

    def check_evidence(self) -> list[str]:
        """Trust again every source untrusted for unknown history whose engine's delivered cached
        tokens agreed with the index often enough (runs every 0.25 s). Returns the sources trusted."""
        need = self._opts.trust_evidence_requests
        trusted = []
        for name, h in self._health.items():
            if not (h.stale and h.evidence_clears):
                continue
            seen, agreed = self._index.delivery_evidence(h.source.engine_id)
            if seen >= need and agreed >= self._opts.trust_evidence_agree * seen:
                h.trust(
                    f"the engine's reported cached tokens agreed with the index on {agreed} of the "
                    f"last {seen} requests (was: {h.stale_reason})"
                )
                # A pending catch-up would rebuild a picture the engine just confirmed, from a
                # buffer that may not reach back: the evidence makes it unnecessary.
                h.pending_resync = None
                h.resync_restart = False
                trusted.append(name)
        for engine_id in {self._health[name].source.engine_id for name in trusted}:
            if not any(h.stale and h.evidence_clears for h in self._sources_of(engine_id)):
                self._index.unwatch_delivery(engine_id)
        return trusted

    def _sources_of(self, engine_id: str) -> list[SourceHealth]:
        return self._by_engine.get(engine_id, [])

    # ----------------------------------------------------------------------------- health

    def _distrust(self, h: SourceHealth, now: float | None = None) -> tuple[str, str | None]:
        """(status, why untrusted or None). One rule for ``health()``, ``trusts()`` and
        ``untrusted_engines()``; ``now`` (the clock) is read only for a publisher gone missing."""
        absent_s = None
        if not h.peer_connected and h.peer_lost_at is not None:
            absent_s = (self._clock() if now is None else now) - h.peer_lost_at
        if absent_s is not None and absent_s > self._opts.peer_grace_s:
            where = "bound at" if h.source.bind else "at"
            return "disconnected", (
                f"no publisher connected {where} {h.source.endpoint} for {absent_s:.1f} s "
                f"(peer_grace_s {self._opts.peer_grace_s:g}): nothing it publishes reaches the index"
            )
        if h.stale:
            return "stale", h.stale_reason
        if not h.connected:
            return "disconnected", None
        return "ok", None

    def source_health(self) -> dict[str, SourceHealth]:
        return dict(self._health)

    def last_batch_at(self, engine_id: str) -> float | None:
        """Clock time of the newest batch from any rank of ``engine_id`` (None: none yet)."""
        times = [
            h.last_event_at
            for h in self._health.values()
            if h.source.engine_id == engine_id and h.last_event_at is not None
        ]
        return max(times) if times else None

    def health(self) -> dict[str, Any]:
        """A JSON-ready snapshot: per source, stream position and problems. "silent" is only
        informative (no event for ``silent_after_s``); whether that is a problem is decided by
        the service from evidence (the engine's own counters)."""
        now = self._clock()
        sources: dict[str, Any] = {}
        for name, h in self._health.items():
            since = now - (h.last_event_at if h.last_event_at is not None else h.started_at)
            silent = since > self._opts.silent_after_s
            status, untrusted_because = self._distrust(h, now)
            if status == "ok" and silent:
                status = "silent"
            unknown_media, size_mismatches = self._index.event_problems(h.source.engine_id)
            sources[name] = {
                "engine_id": h.source.engine_id,
                "dp_rank": h.source.dp_rank,
                "endpoint": h.source.endpoint,
                "mode": "bind" if h.source.bind else "connect",
                "status": status,
                "connected": h.connected,
                "peer_connected": h.peer_connected,
                "silent": silent,
                "stale": h.stale,
                "stale_reason": h.stale_reason,
                "trusted": untrusted_because is None and status != "disconnected",
                "trust_reason": untrusted_because if untrusted_because is not None else h.trusted_reason,
                "trust_log": list(h.trust_log),
                "synced": h.synced,
                "peer_absent_s": None
                if h.peer_connected or h.peer_lost_at is None
                else round(now - h.peer_lost_at, 3),
                "unknown_media": unknown_media,
                "block_size_mismatches": size_mismatches,
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
                "probes": h.probes,
                "probe_batches": h.probe_batches,
                "last_replay_s": None if h.last_replay_s is None else round(h.last_replay_s, 3),
                "last_replay_batches": h.last_replay_batches,
                "restarts": h.restarts,
                "clears": h.clears,
                "decode_errors": h.decode_errors,
                "apply_errors": h.apply_errors,
                "skipped_events": h.skipped_events,
                "duplicates": h.duplicates,
                "seq_regressions": h.seq_regressions,
                "resyncs_deferred": h.resyncs_deferred,
                "reconnects": h.reconnects,
                "task_restarts": h.task_restarts,
                "last_error": h.last_error,
            }
        return {"sources": sources, "discovery_errors": dict(self._discovery_errors)}

    def trusts(self, engine_id: str) -> bool:
        """``engine_id not in untrusted_engines()``, asking only that engine's sources (the
        routing core asks it per candidate and request)."""
        for h in self._by_engine.get(engine_id, ()):  # (a loop: no generator per engine and request)
            if self._distrust(h)[0] != "ok":
                return False
        return True

    def untrusted_engines(self) -> set[str]:
        """Engines whose picture is not trusted (EngineView.index_trusted=False): any rank stale,
        or without a connected publisher past the grace period. Why: ``health()`` per source."""
        now = self._clock()
        return {h.source.engine_id for h in self._health.values() if self._distrust(h, now)[0] != "ok"}


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
