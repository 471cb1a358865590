"""State shared by router replicas through Redis: per-engine load and what each replica routed where.

Each replica keeps its own prefix index (it subscribes to every engine's KV events); only the
fast-changing facts the events cannot tell live here (docs/deployment.md, "Replicas"):
- load: every replica writes its own in-flight requests and queued prefill tokens per engine into
  one hash ``<prefix>load:<replica>`` with a TTL the heartbeat renews, so a dead replica's
  reservations vanish on their own; one Lua script reads the sum of the other live replicas.
- routed: one stream entry per routed request (engine, block keys) in the replica's own stream
  ``<prefix>routed:<replica>``, trimmed by age; every replica tails the others' streams and feeds
  its speculation and approx_prefix's learned table, and a restarted replica replays them to
  relearn what the others routed.
One awaited round trip per request (the read before the policy chooses); the writes go through a
single writer task that sends whatever is pending as one call of a server-side script (one round
trip and one command per batch, applied atomically, in order; deltas to one field are summed). When Redis is
unreachable the replica routes on local knowledge, says so (``up`` False, /ready, metrics) and
rewrites its whole share once Redis answers again.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

log = logging.getLogger("kvroute.shared")

# Sum of the other live replicas' load hashes: [field, value, field, value, ...].
# KEYS[1] = replica registry (zset, score = last heartbeat in ms); ARGV = prefix, own id, stale ms.
_READ_SCRIPT = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], now_ms - tonumber(ARGV[3]), '+inf')
local sums = {}
local order = {}
local live = 0
for _, id in ipairs(ids) do
  if id ~= ARGV[2] then
    local h = redis.call('HGETALL', ARGV[1] .. 'load:' .. id)
    if #h > 0 then live = live + 1 end
    for i = 1, #h, 2 do
      local k = h[i]
      if sums[k] == nil then order[#order + 1] = k; sums[k] = 0 end
      sums[k] = sums[k] + tonumber(h[i + 1])
    end
  end
end
local out = {tostring(live)}
for _, k in ipairs(order) do out[#out + 1] = k; out[#out + 1] = tostring(sums[k]) end
return out
"""

# One writer batch, applied atomically (a reader never sees half of it) in one round trip.
# KEYS = own load hash, own routing stream, replica registry, stream registry.
# ARGV = load TTL ms, stream retention ms, own replica id, then the ops in order:
#   'h', field, delta           HINCRBY in the load hash
#   'w', n, field, value x n    rewrite the whole share (the heartbeat) and renew the registry entry
#   'x', engine id, keys        append a routing record, trimming records older than the retention
# Every batch renews the load hash's TTL (HINCRBY on an expired hash recreates it without one).
_WRITE_SCRIPT = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local i = 4
local routed = false
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'h' then
    redis.call('HINCRBY', KEYS[1], ARGV[i + 1], ARGV[i + 2])
    i = i + 3
  elseif op == 'w' then
    local n = tonumber(ARGV[i + 1])
    redis.call('DEL', KEYS[1])
    for j = 0, n - 1 do
      redis.call('HSET', KEYS[1], ARGV[i + 2 + 2 * j], ARGV[i + 3 + 2 * j])
    end
    redis.call('ZADD', KEYS[3], now_ms, ARGV[3])
    i = i + 2 + 2 * n
  elseif op == 'x' then
    local minid = now_ms - tonumber(ARGV[2])
    redis.call('XADD', KEYS[2], 'MINID', '~', minid, '*', 'e', ARGV[i + 1], 'k', ARGV[i + 2])
    routed = true
    i = i + 3
  else
    return redis.error_reply('kvroute write script: unknown op ' .. tostring(op))
  end
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
if routed then
  -- The stream outlives its replica by the retention (a restart relearns it).
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  redis.call('ZADD', KEYS[4], now_ms, KEYS[2])
end
return i
"""

_IN_FLIGHT = "f:"
_PREFILL = "p:"
#: Upper bound of ``SharedState.tail_poll_s``.
_TAIL_POLL_S = 0.5


def write_script_args(ops: Sequence[tuple[Any, ...]]) -> list[Any]:
    """The write script's ops for a batch of queued writes, in order. Deltas to the same field
    between two rewrites are summed (a request that started and ended in the batch adds nothing)."""
    args: list[Any] = []
    deltas: dict[str, int] = {}

    def flush() -> None:
        for name, delta in deltas.items():
            if delta:
                args.extend(("h", name, delta))
        deltas.clear()

    for op in ops:
        kind = op[0]
        if kind == "reserve":
            _, engine_id, prefill = op
            deltas[_IN_FLIGHT + engine_id] = deltas.get(_IN_FLIGHT + engine_id, 0) + 1
            deltas[_PREFILL + engine_id] = deltas.get(_PREFILL + engine_id, 0) + prefill
        elif kind == "add":
            deltas[op[1]] = deltas.get(op[1], 0) + op[2]
        elif kind == "routed":
            args.extend(("x", op[1], op[2]))
        elif kind == "rewrite":
            deltas.clear()  # already counted in the rewrite's figures (taken after them)
            fields: dict[str, int] = op[1]
            args.extend(("w", len(fields)))
            for name, value in fields.items():
                args.extend((name, value))
        else:
            raise ValueError(f"unknown shared-state write {kind!r}")
    flush()
    return args


@dataclass(slots=True)
class RemoteLoad:
    """The other live replicas' load per engine, as of the last read."""

    in_flight: dict[str, int] = field(default_factory=dict)
    queued_prefill_tokens: dict[str, int] = field(default_factory=dict)
    replicas: int = 0


#: Called for each request another replica routed: (engine id, block keys, seconds since routed).
RoutedListener = Callable[[str, Sequence[int], float], None]


def default_replica_id() -> str:
    """Host name, pid and a random suffix: unique per process, readable in Redis and logs."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class SharedState:
    """One replica's view of and contribution to the shared state (owner: the router's lifespan)."""

    def __init__(
        self,
        redis_url: str,
        *,
        cluster: str = "kvroute",
        replica_id: str = "",
        ttl_s: float = 10.0,
        timeout_s: float = 0.25,
        retention_s: float = 300.0,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if ttl_s <= 0 or timeout_s <= 0 or retention_s <= 0:
            raise ValueError("shared: ttl_s, timeout_s and retention_s must be positive")
        self.redis_url = redis_url
        self.replica_id = replica_id or default_replica_id()
        self.prefix = f"kvroute:{cluster}:"
        self.ttl_s = ttl_s
        #: Heartbeat period: three renewals fit in one TTL, so one lost beat expires nothing.
        self.heartbeat_s = ttl_s / 4
        #: How long the tail waits on the streams it knows before looking for new ones: a new
        #: replica's first routing records reach the others within this (two cheap commands per
        #: period and replica when nothing is routed).
        self.tail_poll_s = min(self.heartbeat_s, _TAIL_POLL_S)
        self.timeout_s = timeout_s
        self.retention_s = retention_s
        self.up = False
        self.last_error = "not started"
        self.remote = RemoteLoad()
        self._local_in_flight: dict[str, int] = {}
        self._local_prefill: dict[str, int] = {}
        self._listeners: list[RoutedListener] = []
        self._queue: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._reader: Any = None  # redis.asyncio.Redis for reads (a pool)
        self._writer: Any = None  # redis.asyncio.Redis with one connection, used by the writer task
        self._tail: Any = None  # blocking XREAD connection
        self._read_sha = ""
        self._write_sha = ""
        #: Last entry id applied per other replica's routing stream.
        self._stream_ids: dict[str, str] = {}
        self._wake = asyncio.Event()
        self._read_task: asyncio.Future[RemoteLoad] | None = None
        #: Writer round trips so far (one per batch; benchmarks divide by requests).
        self.write_batches = 0
        self._metrics(registry)

    # -- metrics --------------------------------------------------------------------------------

    def _metrics(self, registry: CollectorRegistry | None) -> None:
        reg = registry or CollectorRegistry()
        self.m_up = Gauge(
            "kvroute_shared_state_up",
            "1 when this replica shares load and routing with the others through Redis; 0 = local only",
            registry=reg,
        )
        self.m_replicas = Gauge(
            "kvroute_shared_state_replicas",
            "Other live router replicas seen in the last shared-state read",
            registry=reg,
        )
        self.m_errors = Counter(
            "kvroute_shared_state_errors",
            "Failed shared-state operations by kind (read, write, tail, probe)",
            ("op",),
            registry=reg,
        )
        self.m_read_s = Histogram(
            "kvroute_shared_state_read_seconds",
            "Time of a shared-state read of the other replicas' load (concurrent requests share one)",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
            registry=reg,
        )
        self.m_remote_routed = Counter(
            "kvroute_shared_state_remote_routed",
            "Routing records of other replicas applied here (speculation, approx_prefix)",
            registry=reg,
        )
        self.m_up.set(0)

    # -- lifecycle ------------------------------------------------------------------------------

    def add_routed_listener(self, listener: RoutedListener) -> None:
        self._listeners.append(listener)

    async def start(self) -> None:
        import redis.asyncio as aioredis

        def client(**kwargs: Any) -> Any:
            return aioredis.from_url(
                self.redis_url,
                socket_timeout=self.timeout_s,
                socket_connect_timeout=self.timeout_s,
                **kwargs,
            )

        self._reader = client()
        self._writer = client(single_connection_client=True)
        # The tail blocks in XREAD for up to one heartbeat: its socket must wait longer than that.
        self._tail = aioredis.from_url(
            self.redis_url, socket_timeout=self.heartbeat_s + 5.0, socket_connect_timeout=self.timeout_s
        )
        await self._probe()
        if not self.up:
            log.warning(
                "shared state: Redis at %s unreachable (%s); routing on local knowledge until it answers",
                self.redis_url,
                self.last_error,
            )
        self._tasks = [
            asyncio.create_task(self._write_loop(), name="kvroute-shared-writer"),
            asyncio.create_task(self._heartbeat_loop(), name="kvroute-shared-heartbeat"),
            asyncio.create_task(self._tail_loop(), name="kvroute-shared-tail"),
        ]

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=self.timeout_s * 8)
        if self.up:
            # A clean exit takes its share out at once instead of waiting for the TTL.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.timeout_s * 4):
                    await self._writer.delete(self._load_key)
                    await self._writer.zrem(self._registry_key, self.replica_id)
        for conn in (self._reader, self._writer, self._tail):
            if conn is not None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(self.timeout_s * 4):
                        await conn.aclose()
        self.up = False
        self.m_up.set(0)

    @property
    def _load_key(self) -> str:
        return f"{self.prefix}load:{self.replica_id}"

    @property
    def _registry_key(self) -> str:
        return f"{self.prefix}replicas"

    @property
    def _stream_key(self) -> str:
        return f"{self.prefix}routed:{self.replica_id}"

    @property
    def _streams_key(self) -> str:
        return f"{self.prefix}routed-streams"

    def _set_down(self, op: str, exc: BaseException) -> None:
        self.m_errors.labels(op).inc()
        reason = f"{op}: {type(exc).__name__}: {exc}"
        if self.up:
            log.warning(
                "shared state DOWN (%s); this replica now routes on local knowledge only "
                "(other replicas' load and routing unknown) until Redis answers again",
                reason,
            )
        self.up = False
        self.last_error = reason
        self.remote = RemoteLoad()
        self.m_up.set(0)
        self.m_replicas.set(0)

    async def _probe(self) -> None:
        """PING; on success after an outage: load the script, rewrite our share, replay the stream."""
        if self.last_error != "not started":
            # Connections that saw the outage may be half-closed: start every pool afresh.
            for conn in (self._reader, self._writer, self._tail):
                with contextlib.suppress(Exception):
                    await conn.connection_pool.disconnect()
            with contextlib.suppress(Exception):
                if self._writer.connection is not None:
                    await self._writer.connection.disconnect()
        try:
            async with asyncio.timeout(self.timeout_s * 4):
                await self._writer.ping()
            self._read_sha = await self._writer.script_load(_READ_SCRIPT)
            self._write_sha = await self._writer.script_load(_WRITE_SCRIPT)
        except Exception as exc:
            self._set_down("probe", exc)
            return
        if not self.up:
            was_started = self.last_error != "not started"
            self.up = True
            self.last_error = ""
            self.m_up.set(1)
            self._enqueue_rewrite()
            self._wake.set()
            if was_started:
                log.warning("shared state UP again at %s: load and routing shared again", self.redis_url)

    # -- the request path -----------------------------------------------------------------------

    async def refresh(self) -> RemoteLoad:
        """The other replicas' load (one round trip); the last known (empty) one when down.

        Requests that arrive while a read is on its way share it (single flight): under load a
        replica keeps one read in flight, and each answer is at most one round trip old."""
        if not self.up:
            return self.remote
        task = self._read_task
        if task is None or task.done():
            task = self._read_task = asyncio.ensure_future(self._read())
        return await asyncio.shield(task)

    async def _read(self) -> RemoteLoad:
        started_s = time.perf_counter()
        try:
            stale_ms = int(self.ttl_s * 1000)
            async with asyncio.timeout(self.timeout_s):
                raw = await self._reader.evalsha(
                    self._read_sha, 1, self._registry_key, self.prefix, self.replica_id, stale_ms
                )
        except Exception as exc:
            self._set_down("read", exc)
            return self.remote
        self.m_read_s.observe(time.perf_counter() - started_s)
        remote = RemoteLoad(replicas=int(raw[0]))
        for i in range(1, len(raw) - 1, 2):
            name = raw[i].decode() if isinstance(raw[i], bytes) else str(raw[i])
            value = max(0, int(float(raw[i + 1])))
            if name.startswith(_IN_FLIGHT):
                remote.in_flight[name[len(_IN_FLIGHT) :]] = value
            elif name.startswith(_PREFILL):
                remote.queued_prefill_tokens[name[len(_PREFILL) :]] = value
        self.remote = remote
        self.m_replicas.set(remote.replicas)
        return remote

    def reserve(self, engine_id: str, prefill_tokens: int) -> None:
        """This replica sent a request to ``engine_id`` with ``prefill_tokens`` still to compute."""
        self._local_in_flight[engine_id] = self._local_in_flight.get(engine_id, 0) + 1
        self._local_prefill[engine_id] = self._local_prefill.get(engine_id, 0) + prefill_tokens
        if self.up:
            self._queue.put_nowait(("reserve", engine_id, prefill_tokens))

    def routed(self, engine_id: str, block_keys: Sequence[int]) -> None:
        """Tell the other replicas that a prompt with ``block_keys`` went to ``engine_id``."""
        if self.up and block_keys:
            self._queue.put_nowait(("routed", engine_id, array.array("Q", block_keys).tobytes()))

    def first_byte(self, engine_id: str, prefill_tokens: int) -> None:
        """The engine answered: that request's prefill is no longer queued."""
        self._local_prefill[engine_id] = self._local_prefill.get(engine_id, 0) - prefill_tokens
        if self.up and prefill_tokens:
            self._queue.put_nowait(("add", _PREFILL + engine_id, -prefill_tokens))

    def end(self, engine_id: str) -> None:
        self._local_in_flight[engine_id] = self._local_in_flight.get(engine_id, 0) - 1
        if self.up:
            self._queue.put_nowait(("add", _IN_FLIGHT + engine_id, -1))

    def local_share(self) -> dict[str, tuple[int, int]]:
        """This replica's own (in-flight, queued prefill tokens) per engine."""
        engines = self._local_in_flight.keys() | self._local_prefill.keys()
        return {e: (self._local_in_flight.get(e, 0), self._local_prefill.get(e, 0)) for e in engines}

    # -- background -----------------------------------------------------------------------------

    def _enqueue_rewrite(self) -> None:
        # Taken now, applied in queue order: every earlier delta is already in these figures and
        # lands before the rewrite; every later one lands after it.
        fields: dict[str, int] = {}
        for engine_id, (in_flight, prefill) in self.local_share().items():
            fields[_IN_FLIGHT + engine_id] = in_flight
            fields[_PREFILL + engine_id] = prefill
        self._queue.put_nowait(("rewrite", fields))

    async def _write_loop(self) -> None:
        while True:
            ops = [await self._queue.get()]
            while not self._queue.empty():
                ops.append(self._queue.get_nowait())
            if not self.up:
                continue  # the rewrite after recovery restores our share
            args = write_script_args(ops)
            if not args:
                continue  # e.g. a request that began and ended within the batch
            self.write_batches += 1
            try:
                async with asyncio.timeout(self.timeout_s * 4):
                    await self._writer.evalsha(
                        self._write_sha,
                        4,
                        self._load_key,
                        self._stream_key,
                        self._registry_key,
                        self._streams_key,
                        int(self.ttl_s * 1000),
                        int(self.retention_s * 1000),
                        self.replica_id,
                        *args,
                    )
            except Exception as exc:
                self._set_down("write", exc)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if self.up:
                # The full rewrite also heals any delta lost in a failed write.
                self._enqueue_rewrite()
                with contextlib.suppress(Exception):
                    # Drop replicas whose heartbeat stopped (their load hash has expired too).
                    now_ms = int(time.time() * 1000)
                    await self._writer.zremrangebyscore(
                        self._registry_key, "-inf", now_ms - 2 * int(self.ttl_s * 1000)
                    )
                    await self._writer.zremrangebyscore(
                        self._streams_key, "-inf", now_ms - int(self.retention_s * 1000)
                    )
            else:
                await self._probe()

    async def _tail_loop(self) -> None:
        """Apply the other replicas' routing records: each stream from its oldest retained entry
        (what a restarted replica relearns), then live. Every replica writes its own stream, so
        none reads back its own records."""
        while True:
            if not self.up:
                await self._nap()
                continue
            try:
                since_ms = int(time.time() * 1000) - int(self.retention_s * 1000)
                names = await self._tail.zrangebyscore(self._streams_key, since_ms, "+inf")
                streams = {(n.decode() if isinstance(n, bytes) else str(n)): None for n in names}
                streams.pop(self._stream_key, None)
                if not streams:
                    await self._nap(self.tail_poll_s)
                    continue
                wanted = {name: self._stream_ids.get(name, "0-0") for name in streams}
                reply = await self._tail.xread(wanted, block=int(self.tail_poll_s * 1000), count=1000)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._set_down("tail", exc)
                continue
            for stream, entries in reply or ():
                name = stream.decode() if isinstance(stream, bytes) else str(stream)
                self._apply(name, entries)

    async def _nap(self, seconds: float | None = None) -> None:
        """Wait ``seconds`` (one heartbeat by default), or less when Redis comes back (``_probe``
        sets the event)."""
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.heartbeat_s if seconds is None else seconds):
                await self._wake.wait()

    def _apply(self, stream: str, entries: Sequence[Any]) -> None:
        now_ms = time.time() * 1000
        for entry_id, data in entries:
            last = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            self._stream_ids[stream] = last
            age_s = max(0.0, (now_ms - int(last.split("-")[0])) / 1000)
            engine_id = data.get(b"e", b"").decode()
            keys = array.array("Q", data.get(b"k", b"")).tolist()
            if not engine_id or not keys or age_s > self.retention_s:
                continue  # MINID trimming is approximate: older entries may linger
            self.m_remote_routed.inc()
            for listener in self._listeners:
                try:
                    listener(engine_id, keys, age_s)
                except Exception:
                    log.exception("shared state: routed listener %r failed", listener)

    def ready_detail(self) -> dict[str, Any]:
        """The ``shared_state`` part of GET /ready."""
        return {
            "ok": self.up,
            "mode": "shared" if self.up else "local",
            "replica_id": self.replica_id,
            "other_replicas": self.remote.replicas,
            "error": self.last_error,
        }


class SharedLoadLedger:
    """The routing core's load ledger for a replica: its own accounting (``local``, any ledger)
    plus the other replicas' load as of the last ``SharedState.refresh``. Every change of the
    local share is also queued for Redis; reads never wait on Redis."""

    def __init__(self, local: Any, state: SharedState) -> None:
        self.local = local
        self.state = state

    def reserve(self, engine_id: str, prefill_tokens: int) -> Any:
        ticket = self.local.reserve(engine_id, prefill_tokens)
        self.state.reserve(engine_id, prefill_tokens)
        return ticket

    def first_token(self, ticket: Any) -> None:
        if ticket.prefill_pending and not ticket.done:
            self.state.first_byte(ticket.engine_id, ticket.prefill_tokens)
        self.local.first_token(ticket)

    def finish(self, ticket: Any) -> None:
        if ticket.done:
            return
        if ticket.prefill_pending:
            self.state.first_byte(ticket.engine_id, ticket.prefill_tokens)
        self.state.end(ticket.engine_id)
        self.local.finish(ticket)

    def load(self, engine_id: str) -> tuple[int, int]:
        in_flight, queued = self.local.load(engine_id)
        remote = self.state.remote
        return (
            in_flight + remote.in_flight.get(engine_id, 0),
            queued + remote.queued_prefill_tokens.get(engine_id, 0),
        )

    def least_loaded(self) -> list[str]:
        engines = list(self.local.least_loaded())
        return sorted(engines, key=lambda e: (self.load(e)[1], self.load(e)[0]))


class SharedStateAnnotator:
    """Runs the router's annotator, then reads the other replicas' load: the read is the last await
    before the choice, so the policy sees load as fresh as one round trip allows."""

    def __init__(self, inner: Any, state: SharedState) -> None:
        self.inner = inner
        self.state = state

    async def annotate(self, ctx: Any) -> None:
        if self.inner is not None:
            await self.inner.annotate(ctx)
        await self.state.refresh()


class SharedStateObserver:
    """Route observer that owns the SharedState's lifecycle and publishes each routing record
    (engine + prompt block keys); applies the other replicas' records to this replica's index
    (speculation for what is left of its TTL) and to every arm's policy (approx_prefix learns)."""

    def __init__(
        self,
        state: SharedState,
        *,
        engine_ids: Sequence[str],
        index: Any = None,
        speculation_ttl_s: float = 0.0,
        policies: Callable[[], Sequence[Any]] = list,
    ) -> None:
        self.state = state
        self._engine_ids = set(engine_ids)
        self._index = index
        self._speculation_ttl_s = speculation_ttl_s
        self._policies = policies
        state.add_routed_listener(self.apply_remote)

    async def start(self) -> None:
        await self.state.start()

    async def stop(self) -> None:
        await self.state.stop()

    def on_routed(self, ctx: Any) -> None:
        keys = ctx.route_request.block_keys
        if keys and ctx.decision is not None:
            self.state.routed(ctx.decision.engine_id, keys)

    def on_first_byte(self, ctx: Any) -> None:
        return None

    def on_finished(self, ctx: Any) -> None:
        return None

    def apply_remote(self, engine_id: str, keys: Sequence[int], age_s: float) -> None:
        from policies.base import Decision, RouteRequest

        if engine_id not in self._engine_ids:
            return  # another fleet's config, or an engine this replica does not route to
        now = time.monotonic()
        left_s = self._speculation_ttl_s - age_s
        if self._index is not None and left_s > 0:
            self._index.speculate(engine_id, keys, left_s, now)
        request = RouteRequest(request_id="remote", block_keys=tuple(keys))
        for policy in self._policies():
            decision = Decision(engine_id, policy.name, "routed by another replica")
            learn = getattr(policy, "learn_routed", None)
            if learn is not None:  # a policy that keeps time: the record is age_s old
                learn(request, decision, now - age_s)
            else:
                policy.on_routed(request, decision)
