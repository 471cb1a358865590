"""KV-cache events on ZeroMQ, byte-compatible with vLLM 0.33's ZmqEventPublisher.

Live frames are PUB ``[topic, seq (8-byte BE), msgpack([ts, events, dp_rank])]``; an optional ROUTER
socket replays buffered batches to a DEALER. Config mirrors vLLM's ``--kv-events-config`` JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import zmq
import zmq.asyncio

from kvcore.wire import (
    END_SEQ_BYTES,
    AllBlocksCleared,
    BatchEncoder,
    BlockRemoved,
    BlockStored,
    event_struct,
    offset_endpoint_port,
    publisher_binds,
    with_host,
)

log = logging.getLogger(__name__)

#: Replay end marker's seq frame (vLLM sends -1 as 8 signed bytes).
END_SEQ = END_SEQ_BYTES
__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BatchEncoder",
    "BlockRemoved",
    "BlockStored",
    "KVEventsConfig",
    "ZmqEventPublisher",
    "endpoint_binds",
    "event_struct",
    "offset_endpoint_port",
    "parse_kv_events_config",
    "resolved_source",
]


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` keys, same names and defaults."""

    enable_kv_cache_events: bool = False
    #: Only "zmq" is implemented (vLLM also has "null").
    publisher: str = "zmq"
    #: PUB endpoint; binds when it holds '*', '::', ipc:// or inproc://, else connects out.
    endpoint: str = "tcp://*:5557"
    #: ROUTER endpoint for replay (always binds); None = no replay.
    replay_endpoint: str | None = None
    #: Batches kept for replay.
    buffer_steps: int = 10_000
    #: ZMQ send high-water mark of the PUB socket.
    hwm: int = 100_000
    #: Accepted for compatibility; the sim publishes synchronously so it has no queue.
    max_queue_size: int = 100_000
    topic: str = ""


def parse_kv_events_config(raw: str | Mapping[str, Any] | None) -> KVEventsConfig:
    """Parse a ``--kv-events-config`` JSON string or dict; unknown keys are rejected like vLLM does."""
    if raw is None or raw == "":
        return KVEventsConfig()
    if isinstance(raw, str):
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from None
    else:
        data = dict(raw)
    if not isinstance(data, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    known = {f.name for f in fields(KVEventsConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"--kv-events-config: unknown key(s) {unknown}; accepted keys are {sorted(known)}")
    cfg = KVEventsConfig(**data)
    if cfg.publisher not in ("zmq", "null"):
        raise ValueError(f"--kv-events-config: publisher must be 'zmq' or 'null', got {cfg.publisher!r}")
    if cfg.buffer_steps < 1:
        raise ValueError("--kv-events-config: buffer_steps must be >= 1")
    if cfg.enable_kv_cache_events and cfg.publisher == "zmq" and not cfg.endpoint:
        raise ValueError("--kv-events-config: endpoint is required when events are enabled")
    return cfg


#: vLLM's bind-or-connect rule and rank offset: one implementation, shared with the router.
endpoint_binds = publisher_binds


def resolved_source(cfg: KVEventsConfig, server_host: str, dp_rank: int = 0) -> dict[str, Any]:
    """One rank's publisher config as ``GET /kv_event_sources`` shows it (wildcard host -> the
    server's host, IPv6 in brackets; port + rank)."""
    out = asdict(cfg)
    for key in ("endpoint", "replay_endpoint"):
        value = out[key]
        if value:
            out[key] = with_host(offset_endpoint_port(value, dp_rank), server_host)
    return out


class ZmqEventPublisher:
    """One data-parallel rank's publisher: PUB socket, replay ROUTER, ring buffer of batches.

    ``publish`` is synchronous and non-blocking (PUB drops at the high-water mark, as vLLM's does);
    the replay server is an asyncio task owned by this object (``start``/``close``).
    """

    def __init__(self, cfg: KVEventsConfig, dp_rank: int = 0) -> None:
        self.cfg = cfg
        self.dp_rank = dp_rank
        self.endpoint = offset_endpoint_port(cfg.endpoint, dp_rank)
        self.replay_endpoint = (
            offset_endpoint_port(cfg.replay_endpoint, dp_rank) if cfg.replay_endpoint else None
        )
        self._topic = cfg.topic.encode()
        self._encoder = BatchEncoder()
        self._next_seq = 0
        self._buffer: deque[tuple[bytes, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context.shadow(self._ctx)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.batches_published = 0
        self.events_published = 0
        try:
            if endpoint_binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint:
                self._replay = self._actx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # A ROUTER drops what exceeds its send high-water mark (default 1,000): a whole
                # buffer (10,000 batches by default) plus the end marker must fit in one answer.
                self._replay.setsockopt(zmq.SNDHWM, cfg.buffer_steps + 2)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(
                f"cannot open KV event sockets {self.endpoint} / {self.replay_endpoint}: {exc}; "
                "pick free ports in --kv-events-config"
            ) from exc

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def start(self) -> None:
        """Start answering replay requests (needs a running event loop)."""
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(
                self._serve_replay(), name=f"kv-replay-{self.replay_endpoint}"
            )

    def publish(self, events: Sequence[Mapping[str, Any]], ts_s: float | None = None) -> int:
        """Send one batch (one engine step's events); returns its seq. Empty batches are not sent."""
        if not events:
            return -1
        seq = self._next_seq
        self._next_seq += 1
        seq_bytes = seq.to_bytes(8, "big")
        payload = self._encoder.encode(time.time() if ts_s is None else ts_s, events, self.dp_rank)
        self._buffer.append((seq_bytes, payload))
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, seq_bytes, payload), flags=zmq.NOBLOCK, copy=False)
        self.batches_published += 1
        self.events_published += len(events)
        return seq

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        sock = self._replay
        while True:
            frames = await sock.recv_multipart()
            try:
                await self._answer_replay(sock, frames)
            except zmq.ZMQError as exc:
                log.warning("kv replay: could not answer %s: %s", self.replay_endpoint, exc)

    async def _answer_replay(self, sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        # A DEALER sends [b"", start_seq]; the ROUTER prepends the peer identity.
        if len(frames) < 3 or len(frames[-1]) != 8:
            log.warning("kv replay: ignoring malformed request with %d frames", len(frames))
            return
        identity = frames[0]
        start_seq = int.from_bytes(frames[-1], "big")
        for seq_bytes, payload in list(self._buffer):
            if int.from_bytes(seq_bytes, "big") >= start_seq:
                await sock.send_multipart((identity, b"", self._topic, seq_bytes, payload))
        await sock.send_multipart((identity, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    async def close(self) -> None:
        """Stop the replay task and close the sockets."""
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        self._close_sockets()


def with_endpoints(cfg: KVEventsConfig, endpoint: str, replay_endpoint: str | None) -> KVEventsConfig:
    """A copy of ``cfg`` with other endpoints (used by the fleet to assign free ports)."""
    return replace(cfg, endpoint=endpoint, replay_endpoint=replay_endpoint)


def _benchmark(batch_events: int, num_batches: int) -> None:
    """Publish synthetic GPU BlockStored batches to a real SUB on loopback TCP; print events/s."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def run() -> None:
        cfg = KVEventsConfig(
            enable_kv_cache_events=True, endpoint=f"tcp://*:{port}", topic="kv-events", hwm=0
        )
        publisher = ZmqEventPublisher(cfg)
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.connect(f"tcp://127.0.0.1:{port}")
        await asyncio.sleep(0.3)  # let the subscription arrive before the first batch
        batches = [
            [
                {"type": "BlockStored", "block_hashes": [2 * i + 1], "parent_block_hash": 2 * i,
                 "token_ids": list(range(16)), "block_size": 16, "lora_id": None, "medium": "GPU",
                 "lora_name": None, "group_idx": 0}
                for i in range(b * batch_events, (b + 1) * batch_events)
            ]
            for b in range(num_batches)
        ]  # fmt: skip
        try:
            t0 = time.perf_counter()
            for events in batches:
                publisher.publish(events)
            publish_s = time.perf_counter() - t0
            received = 0
            while received < num_batches and sub.poll(2000):
                sub.recv_multipart()
                received += 1
            total_s = time.perf_counter() - t0
        finally:
            sub.close(linger=0)
            ctx.term()
            await publisher.close()
        n = batch_events * num_batches
        print(
            f"{batch_events:3d} events/batch: publish {n / publish_s:>10,.0f} events/s "
            f"({num_batches / publish_s:,.0f} batches/s); received {received}/{num_batches} batches, "
            f"end to end {n / total_s:,.0f} events/s"
        )

    asyncio.run(run())


if __name__ == "__main__":
    # python -m sim.zmq_publisher: publish-rate benchmark (encoding + PUB send + SUB receive on loopback).
    for batch_events, num_batches in ((1, 20_000), (16, 20_000), (64, 5_000)):
        _benchmark(batch_events, num_batches)
