"""The router's one typed configuration: TOML file, ``KVROUTE_*`` env vars and CLI flags.

Precedence: flags > env > file > defaults (docs/configuration.md). ``load_config`` merges the
layers as plain dicts, converts them into the Structs below and validates; any problem raises
``ConfigError`` naming the key and what is accepted. Fleet files (written by ``kvroute fleet``)
are read and written by ``load_fleet_file`` / ``write_fleet_file``.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec

from kvcore.core import (
    ESCALATE_PICKS,
    PRIORITY_FCFS_FACTOR,
    PRIORITY_MAX_OVERTAKE_S,
    PRIORITY_RECOMPUTE_BELOW,
    PRIORITY_RECOMPUTE_FCFS_FACTOR,
    PRIORITY_STEP_S,
    PRIORITY_STRETCH,
    SCHEDULING_POLICIES,
    check_pool_bandwidth,
    check_priority_fcfs_factor,
    check_priority_max_overtake,
    check_priority_stretch,
    check_recompute_below,
)
from policies.base import needs_block_keys

ENV_PREFIX = "KVROUTE_"
FLEET_FILE_VERSION = 1


class ConfigError(ValueError):
    """Invalid configuration; the message names the key and the accepted values."""


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One vLLM engine (or simulated engine) behind the router."""

    #: Unique id used in metrics, headers and the index.
    id: str
    #: Base URL of the OpenAI server, e.g. "http://10.0.0.5:8000" (no trailing /v1).
    url: str
    #: Model name the engine serves; "" = learn it from the engine's GET /v1/models.
    model: str = ""
    #: ZMQ endpoint of the engine's KV-event PUB socket, e.g. "tcp://10.0.0.5:5557" ("" = none).
    kv_events_endpoint: str = ""
    #: ZMQ endpoint of the engine's replay ROUTER socket ("" = no replay).
    kv_replay_endpoint: str = ""
    #: Topic the engine publishes on ("" = all).
    kv_events_topic: str = ""
    #: "auto": vLLM's rule - an endpoint with a wildcard (``*``, ``::``) or ipc is bound by the
    #: engine and we connect (wildcard -> the url's host); a concrete host other than the engine's
    #: means the engine connects out to us and we bind there. "bind" / "connect" force the mode.
    kv_events_mode: str = "auto"
    #: vLLM --data-parallel-size: rank r publishes on the event and replay ports + r.
    data_parallel_size: int = 1
    #: Id of the shared storage pool this engine mounts ("" = none / private).
    storage_pool: str = ""
    #: Tokens per KV block of this engine.
    block_size: int = 16
    #: The engine's vLLM ``--scheduling-policy``. "priority": the router sends each request a
    #: ``priority``, a deadline from its predicted own service (costs.priority_*; docs/routing.md,
    #: "Shortest work first"); "fcfs" (vLLM's default) sends none: an fcfs vLLM accepts a priority
    #: and ignores it.
    scheduling_policy: str = "fcfs"


class PolicyConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A policy by registered name plus its constructor parameters."""

    name: str = "round_robin"
    params: dict[str, Any] = msgspec.field(default_factory=dict)


class ArmConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One arm of an A/B experiment."""

    name: str
    policy: str
    params: dict[str, Any] = msgspec.field(default_factory=dict)
    weight: float = 1.0


class ExperimentConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Arms to split conversations between (sticky per session key). Empty = no experiment."""

    name: str = "default"
    arms: list[ArmConfig] = msgspec.field(default_factory=list)


class TokenizerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How the router turns a prompt into tokens (used by index-aware policies)."""

    #: "none" (estimate length only), "sim" (kvroute-sim template), "hf" (tokenizers + jinja2
    #: chat template from ``path``), "engine" (the engine's POST /tokenize).
    backend: str = "none"
    #: Tokenizer directory or tokenizer.json for backend "hf".
    path: str = ""
    #: Key namespace (router.keys.namespace_seed); equal on every router replica of a fleet.
    namespace: str = ""
    #: Characters per token when only estimating prompt length.
    chars_per_token: float = 4.0
    #: Memory bound of the tokenizer's conversation-prefix cache (entries evicted by size).
    cache_max_bytes: int = 64 * 1024 * 1024
    #: Tokenizer parity (router/parity.py): the router's prompt token count and the engine's
    #: ``usage.prompt_tokens`` may differ by this many tokens (a template's tail) and still agree.
    parity_tail_tokens: int = 8
    #: ... an engine is distrusted when ``parity_min_mismatches`` of its last ``parity_window``
    #: answers disagree, and trusted again after ``parity_window`` agree in a row.
    parity_window: int = 8
    parity_min_mismatches: int = 4


class LimitsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Request size and upstream timeouts."""

    #: Largest request body accepted (413 above).
    max_body_bytes: int = 16 * 1024 * 1024
    #: Time to open a TCP connection to an engine.
    connect_timeout_s: float = 5.0
    #: Longest wait for the next bytes from an engine, the first ones included (504 before any).
    read_timeout_s: float = 600.0
    #: Max connections kept per engine (0 = unlimited).
    max_connections_per_engine: int = 0
    #: Output tokens assumed when a request sets no max_tokens.
    default_output_tokens: int = 256
    #: Largest prompt accepted, in tokens as estimated from its characters (chars_per_token)
    #: before any tokenising (400 prompt_too_long above); 0 = no limit.
    max_prompt_tokens: int = 262_144
    #: Longest wait for an engine's first byte of an answer (its prefill included); on expiry the
    #: request fails over to the next engine if nothing was sent to the client yet, else 504.
    #: 0 = from the measured time to first token: 4 x its p99, within 5..60 s, 30 s until 20 streams
    #: were measured (router/first_byte.py).
    first_byte_timeout_s: float = 0.0
    #: On SIGTERM, seconds in-flight requests may take to finish before they are cut (0 = no bound).
    drain_timeout_s: float = 30.0
    #: A client must send its complete request headers within this time (408, connection closed).
    header_timeout_s: float = 10.0
    #: A client must send its complete request body within this time (408).
    body_timeout_s: float = 60.0
    #: A client that takes none of the answer bytes waiting for it (the router's write buffer to
    #: it full) for this long is cut: its connection and the engine's are aborted, so the engine
    #: stops the request. Progress restarts the clock; 0 = no bound (router/guard.py).
    client_write_timeout_s: float = 60.0
    #: Request line + headers larger than this are refused (431, connection closed).
    max_header_bytes: int = 32 * 1024
    #: Requests with more header lines than this are refused (431).
    max_headers: int = 100
    #: Open client connections beyond this are closed at once; keep it below the process's
    #: open-file limit (ulimit -n) so /health and the engines stay reachable. 0 = no limit.
    max_connections: int = 900
    #: Approximate memory for the conversation -> experiment-arm map (fixed-size entries).
    session_map_bytes: int = 32 * 1024 * 1024


class HealthConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Background polling of each engine's GET /health."""

    #: Seconds between polls; 0 disables polling (engines stay healthy until a refusal).
    interval_s: float = 2.0
    #: Timeout of one poll.
    timeout_s: float = 2.0
    #: Consecutive failed polls before an engine is marked unhealthy (one slow /health is not death).
    failures_before_unhealthy: int = 3
    #: A proxied answer from the engine within this many seconds counts as proof of life: failed
    #: polls do not mark it unhealthy meanwhile.
    answer_liveness_s: float = 10.0
    #: Circuit breaker: consecutive failed proxied requests (refused, reset, first-byte timeout)
    #: that take an engine out of routing.
    breaker_failures: int = 3
    #: Seconds an open breaker keeps the engine out before one trial request is let through.
    breaker_open_s: float = 5.0


class ListenConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 8000


class ProxyConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How the proxied routes run inside the router process."""

    #: Answer the common request (body complete, no API key to check, a decision that needs no
    #: await, an idle keep-alive connection to the chosen engine) entirely in the HTTP protocols'
    #: callbacks, without an asyncio task, a stream's events relayed read by read; anything else
    #: goes on as a task from the point reached, a stream back in callbacks from its first event
    #: (router/fastpath.py, router/routing.py). Off = every request runs as a task. "idle" = on
    #: for a request that arrives while no other exchange with an engine is in progress in this
    #: process (the latency of a lightly loaded router), off otherwise (under load the task path
    #: serves more requests a second: docs/benchmarks.md). An integer N >= 1: on while fewer than
    #: N other exchanges are in progress ("idle" is 1).
    callback_path: bool | int | Literal["idle"] = "idle"
    #: Run the accounting that follows an answer out (the TTFT model's learning, the index's
    #: delivered-blocks check, experiments, the observers: metrics, first-byte budget, liveness,
    #: traces; the log line) later: when the next request has gone to its engine, a 2 ms timer
    #: or 256 queued, whichever first; drained before GET /metrics, the explain endpoint and at
    #: shutdown. The load is released at once either way (router/after_answer.py). On by default
    #: since round dp26 (docs/results/dp26.md); off = all of it right after the answer's write.
    defer_accounting: bool = True


class IndexConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The global prefix index fed by the engines' KV events (router/index.py)."""

    #: False = no index and no event subscriptions (index-aware policies then see no matches).
    enabled: bool = True
    #: Capacity in blocks of each shared STORAGE pool named by an engine's ``storage_pool``.
    storage_pool_blocks: int = 500_000
    #: Per-pool capacity overrides, e.g. {"nvme-shared-a": 2000000} (JSON in env vars).
    pools: dict[str, int] = msgspec.field(default_factory=dict)
    #: Seconds a routed prompt's blocks count as (speculative) GPU entries on the chosen engine
    #: before its BlockStored events confirm them; 0 disables speculation.
    speculation_ttl_s: float = 2.0


class EventsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Subscriptions to the engines' KV-event publishers (router/events.py)."""

    #: An engine that got traffic but whose source published nothing for this long is reported
    #: (GET /ready, metric kvroute_event_source_silent, one warning).
    silent_after_s: float = 30.0
    #: Ask GET /kv_event_sources of engines without a configured kv_events_endpoint.
    discover: bool = True
    #: Seconds to wait for a replay answer after a sequence gap.
    replay_timeout_s: float = 2.0


class CostsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The measured cost model tier_cost prices requests with (policies/costs.py)."""

    #: Priors for CostModel.from_config: prefill_tokens_per_s, kv_bytes_per_token,
    #: load_bandwidth_bytes_per_s / load_latency_s per tier, engines = {id: overrides},
    #: calibration = {...} (see docs/configuration.md).
    priors: dict[str, Any] = msgspec.field(default_factory=dict)
    #: Seconds between scrapes of each engine's GET /metrics; 0 disables scraping.
    scrape_interval_s: float = 2.0
    #: Engines with ``scheduling_policy: priority``: seconds per vLLM priority level; the deadline
    #: as ``priority_stretch`` times its own predicted service (loads + prefill) after placement
    #: (0 = arrival order), never more than ``priority_max_overtake_s`` after it (the bound; inf =
    #: none) nor more than ``priority_fcfs_factor`` times its predicted first-come TTFT on that
    #: engine (the relative bound, >= 1; inf = off). kvcore.core.shortest_first_priority.
    #: ``priority_recompute_fcfs_factor``: the relative bound of a request no engine holds
    #: ``priority_recompute_below`` of its prompt (a recompute), when tighter (>= 1; inf = off).
    #: kvcore.core.priority_fcfs_factor_for.
    priority_step_s: float = PRIORITY_STEP_S
    priority_stretch: float = PRIORITY_STRETCH
    priority_max_overtake_s: float = PRIORITY_MAX_OVERTAKE_S
    priority_fcfs_factor: float = PRIORITY_FCFS_FACTOR
    priority_recompute_fcfs_factor: float = PRIORITY_RECOMPUTE_FCFS_FACTOR
    priority_recompute_below: float = PRIORITY_RECOMPUTE_BELOW
    #: Escalation (docs/routing.md, "Escalation"): a stream sent to a priority engine with the
    #: router's priority and no first event ``priority_escalate_after_s`` seconds after its body
    #: arrived is cancelled there (its connection closed: vLLM drops the request at once and keeps
    #: its computed blocks cached) and sent again with priority 0, ahead of every deadline, to
    #: ``priority_escalate_pick``: "same" (the engine it was on), "route" (where the policy routes
    #: it then) or "other" (where the policy routes it among the other engines). 0 = off. Streams
    #: only: a non-stream answer shows no first token before its end.
    priority_escalate_after_s: float = 0.0
    priority_escalate_pick: str = "same"
    #: Shared STORAGE pool (an engine's ``storage_pool``) -> its aggregate bandwidth in bytes/s,
    #: what the storage system moves for all its clients together, reads and writes. A pool listed
    #: here has its traffic booked: each request the router places on one of its engines queues its
    #: STORAGE read there, first come, and (``storage_pool_write_through``) the blocks it computes,
    #: which the engines write through to the pool; index-reading policies price a STORAGE hit with
    #: the wait behind what is booked ahead (kvcore.core.StorageReadQueue; docs/routing.md, "The
    #: shared pool's read queue"). Each router replica books only its own requests. Empty = none.
    storage_pool_bandwidth: dict[str, float] = msgspec.field(default_factory=dict)
    #: The engines write every block they compute through to their pool (vLLM's tiering manager
    #: with an fs tier): book those writes too. False = book the reads only.
    storage_pool_write_through: bool = True


class AdminConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Admin endpoints (POST /admin/reload, POST /admin/engines/{id}/drain)."""

    #: Bearer token; "" disables the admin endpoints (404).
    token: str = ""


class AuthConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Client API keys and access to the introspection endpoints (docs/security.md)."""

    #: Client API key -> tenant name. Non-empty: /v1/* needs "Authorization: Bearer <key>" (401).
    #: Keys mapped to the same tenant share cached prefixes (see tenancy).
    api_keys: dict[str, str] = msgspec.field(default_factory=dict)
    #: Production mode: the introspection endpoints default to "admin" instead of "open".
    production: bool = False
    #: Who may call /v1/route/explain, /debug/*, /v1/experiments: "open" (anyone), "api_key"
    #: (any client key or the admin token), "admin" (admin.token only), "off" (404); "" = "open",
    #: or "admin" in production mode.
    debug_access: str = ""
    #: Failed authentications per minute, counted per client address and per presented
    #: credential, before that address's (or credential's) failures are answered 429. A valid
    #: credential is never refused.
    max_failures_per_minute: int = 30
    #: Addresses or CIDR ranges of the load balancers / proxies in front of the router. Only a
    #: connection from one of them has its client address taken from ``X-Forwarded-For`` (the
    #: rightmost entry that is not itself a trusted proxy); empty = the header is ignored.
    trusted_proxies: list[str] = msgspec.field(default_factory=list)

    def debug_mode(self) -> str:
        return self.debug_access or ("admin" if self.production else "open")


class TenancyConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Per-tenant cache isolation: the router puts a tenant's own ``cache_salt`` into every request,
    so two tenants never share KV blocks (nor learn through timing what the other sent)."""

    #: Where the tenant comes from: "auto" (the API key's tenant when auth.api_keys is set, else
    #: none), "api_key", "header" (``header``, set by a trusted gateway) or "none".
    source: str = "auto"
    #: Request header naming the tenant for source "header".
    header: str = "x-tenant-id"


class TraceConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Recording the router's traffic as a Mooncake-format JSONL trace (hashes only, no text)."""

    #: Output file; "" = no recording.
    path: str = ""
    #: Tokens per trace block (Mooncake uses 512); a multiple of the engines' block size.
    block_tokens: int = 512


class SharedConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """State shared by router replicas through Redis (router/shared_state.py, docs/deployment.md)."""

    #: e.g. "redis://redis:6379/0"; "" = this router shares nothing (one replica).
    redis_url: str = ""
    #: Key prefix: replicas of one fleet use the same name, other fleets another.
    cluster: str = "kvroute"
    #: This replica's id in Redis; "" = host name, pid and a random suffix.
    replica_id: str = ""
    #: A replica's load share expires this long after its last heartbeat (a crashed replica's
    #: reservations vanish); heartbeats run every ttl_s / 4.
    ttl_s: float = 10.0
    #: Longest wait for Redis on the request path before routing on local knowledge.
    timeout_s: float = 0.25
    #: How long routing records (engine, block keys) stay in Redis for speculation, approx_prefix
    #: and replicas that restart.
    retention_s: float = 300.0


class RouterConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Everything ``kvroute serve`` needs."""

    engines: list[EngineConfig] = msgspec.field(default_factory=list)
    policy: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    experiment: ExperimentConfig = msgspec.field(default_factory=ExperimentConfig)
    tokenizer: TokenizerConfig = msgspec.field(default_factory=TokenizerConfig)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    health: HealthConfig = msgspec.field(default_factory=HealthConfig)
    listen: ListenConfig = msgspec.field(default_factory=ListenConfig)
    index: IndexConfig = msgspec.field(default_factory=IndexConfig)
    events: EventsConfig = msgspec.field(default_factory=EventsConfig)
    costs: CostsConfig = msgspec.field(default_factory=CostsConfig)
    admin: AdminConfig = msgspec.field(default_factory=AdminConfig)
    auth: AuthConfig = msgspec.field(default_factory=AuthConfig)
    tenancy: TenancyConfig = msgspec.field(default_factory=TenancyConfig)
    trace: TraceConfig = msgspec.field(default_factory=TraceConfig)
    shared: SharedConfig = msgspec.field(default_factory=SharedConfig)
    proxy: ProxyConfig = msgspec.field(default_factory=ProxyConfig)
    #: Fleet file whose engines are appended to ``engines``.
    fleet_file: str = ""
    log_level: str = "info"


_SECTIONS: dict[str, type[msgspec.Struct]] = {
    "policy": PolicyConfig,
    "experiment": ExperimentConfig,
    "tokenizer": TokenizerConfig,
    "limits": LimitsConfig,
    "health": HealthConfig,
    "listen": ListenConfig,
    "index": IndexConfig,
    "events": EventsConfig,
    "costs": CostsConfig,
    "admin": AdminConfig,
    "auth": AuthConfig,
    "tenancy": TenancyConfig,
    "trace": TraceConfig,
    "shared": SharedConfig,
    "proxy": ProxyConfig,
}
#: Keys whose env-var values are JSON (dicts and lists).
_JSON_KEYS = ("params", "arms", "pools", "priors", "api_keys", "storage_pool_bandwidth")
_TOP_SCALARS = {"fleet_file", "log_level"}
_TOKENIZER_BACKENDS = ("none", "sim", "hf", "engine")
_KV_EVENTS_MODES = ("auto", "connect", "bind")
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _accepted(cls: type[msgspec.Struct]) -> str:
    return ", ".join(cls.__struct_fields__)


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``; ``params`` is replaced whole, and a policy renamed by a higher
    layer drops the lower layer's params (they belonged to the other policy)."""
    out = dict(base)
    if "name" in over and over.get("name") != out.get("name") and "params" not in over:
        out.pop("params", None)
    for key, value in over.items():
        replaced_whole = key in ("params", "priors", "pools", "api_keys")
        if not replaced_whole and isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def env_layer(environ: Mapping[str, str]) -> dict[str, Any]:
    """Config dict from ``KVROUTE_<SECTION>_<KEY>`` (e.g. KVROUTE_LISTEN_PORT=9000),
    ``KVROUTE_LOG_LEVEL``, ``KVROUTE_FLEET_FILE`` and ``KVROUTE_ENGINES`` (JSON list or
    ``id=url,id=url``). Values are strings, converted by type later; JSON for dicts."""
    out: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        if rest in ("config", "fleet"):  # file paths read by the CLI, not config keys
            continue
        if rest == "engines":
            out["engines"] = _parse_engines_text(raw, source=name)
            continue
        if rest in _TOP_SCALARS:
            out[rest] = raw
            continue
        section, _, key = rest.partition("_")
        cls = _SECTIONS.get(section)
        if cls is None or key not in cls.__struct_fields__:
            accepted = [
                f"{ENV_PREFIX}{s.upper()}_{f.upper()}"
                for s, c in _SECTIONS.items()
                for f in c.__struct_fields__
            ]
            raise ConfigError(
                f"unknown environment variable {name}; accepted: {ENV_PREFIX}ENGINES, "
                f"{ENV_PREFIX}LOG_LEVEL, {ENV_PREFIX}FLEET_FILE, {', '.join(accepted)}"
            )
        value: Any = raw
        if key in _JSON_KEYS:
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{name} must be JSON: {exc}") from None
        out.setdefault(section, {})[key] = value
    return out


def _parse_engines_text(raw: str, *, source: str) -> list[dict[str, Any]]:
    text = raw.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source} must be a JSON list of engines or id=url,...: {exc}") from None
        if not isinstance(value, list):
            raise ConfigError(f"{source} must be a JSON list of engines")
        return value
    engines = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        engine_id, sep, url = item.partition("=")
        if not sep:
            raise ConfigError(f"{source}: {item!r} is not id=url (e.g. e0=http://127.0.0.1:8001)")
        engines.append({"id": engine_id.strip(), "url": url.strip()})
    return engines


_CALLBACK_PATH_HINT = '; accepted: true, false, "idle" or an integer >= 1'


def callback_path_below(value: bool | int | str) -> int | None:
    """How many other exchanges in progress turn proxy.callback_path off: None = never (``true``),
    0 = always (``false``), 1 for "idle", N for an integer N."""
    if value is True:
        return None
    if value is False:
        return 0
    return 1 if value == "idle" else int(value)


def _convert(data: Mapping[str, Any]) -> RouterConfig:
    try:
        return msgspec.convert(data, RouterConfig, strict=False)
    except msgspec.ValidationError as exc:
        text = str(exc)
        hint = ""
        if "unknown field" in text:
            where = text.rsplit("`$", 1)[-1].rstrip("`").strip(".")
            section = where.split(".")[0].split("[")[0] if where else ""
            sections: dict[str, type[msgspec.Struct]] = {"engines": EngineConfig, **_SECTIONS}
            cls = sections.get(section, RouterConfig)
            if section == "experiment" and "arms" in where:
                cls = ArmConfig
            hint = f"; accepted keys here: {_accepted(cls)}"
        elif text.endswith("`$.proxy.callback_path`"):
            hint = _CALLBACK_PATH_HINT
        raise ConfigError(f"invalid config: {text}{hint}") from None


def validate(config: RouterConfig) -> RouterConfig:
    """Semantic checks msgspec cannot express; raises ConfigError naming the key."""
    from policies.base import REGISTRY, build_policy

    seen: set[str] = set()
    for i, engine in enumerate(config.engines):
        where = f"engines[{i}]"
        if not engine.id:
            raise ConfigError(f"{where}.id must be a non-empty string")
        if engine.id in seen:
            raise ConfigError(f"{where}.id {engine.id!r} is used twice; engine ids must be unique")
        seen.add(engine.id)
        parts = urlsplit(engine.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"{where}.url {engine.url!r} must be http(s)://host:port")
        if engine.block_size <= 0:
            raise ConfigError(f"{where}.block_size must be a positive integer, got {engine.block_size}")
        for key in ("kv_events_endpoint", "kv_replay_endpoint"):
            value = getattr(engine, key)
            if value and "://" not in value:
                raise ConfigError(f"{where}.{key} {value!r} must be a ZMQ endpoint like tcp://host:port")
        if engine.kv_events_mode not in _KV_EVENTS_MODES:
            raise ConfigError(
                f"{where}.kv_events_mode {engine.kv_events_mode!r} unknown; accepted: "
                f"{', '.join(_KV_EVENTS_MODES)}"
            )
        if engine.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(
                f"{where}.scheduling_policy {engine.scheduling_policy!r} unknown; accepted: "
                f"{', '.join(SCHEDULING_POLICIES)} (the engine's vLLM --scheduling-policy)"
            )
        if not isinstance(engine.data_parallel_size, int) or engine.data_parallel_size < 1:
            raise ConfigError(
                f"{where}.data_parallel_size must be an integer >= 1, got {engine.data_parallel_size!r}"
            )
    callback_path = config.proxy.callback_path
    if not isinstance(callback_path, bool) and isinstance(callback_path, int) and callback_path < 1:
        raise ConfigError(f"proxy.callback_path must not be {callback_path}{_CALLBACK_PATH_HINT}")
    if not 0 <= config.listen.port <= 65535:
        raise ConfigError(f"listen.port must be 0..65535, got {config.listen.port}")
    limits = config.limits
    for key in ("max_body_bytes", "connect_timeout_s", "read_timeout_s"):
        if getattr(limits, key) <= 0:
            raise ConfigError(f"limits.{key} must be positive, got {getattr(limits, key)}")
    if config.health.interval_s < 0 or config.health.timeout_s <= 0:
        raise ConfigError("health.interval_s must be >= 0 (0 disables) and health.timeout_s > 0")
    _validate_limits_auth(config)
    if config.tokenizer.backend not in _TOKENIZER_BACKENDS:
        raise ConfigError(
            f"tokenizer.backend {config.tokenizer.backend!r} unknown; "
            f"accepted: {', '.join(_TOKENIZER_BACKENDS)}"
        )
    _validate_index_events_costs(config)
    if config.log_level.lower() not in _LOG_LEVELS:
        raise ConfigError(f"log_level {config.log_level!r} unknown; accepted: {', '.join(_LOG_LEVELS)}")
    arm_names: set[str] = set()
    for i, arm in enumerate(config.experiment.arms):
        if not arm.name or arm.name in arm_names:
            raise ConfigError(f"experiment.arms[{i}].name must be unique and non-empty, got {arm.name!r}")
        arm_names.add(arm.name)
        if not arm.weight >= 0:
            # 0 keeps an arm's sessions but sends it no new ones (winding an arm down).
            raise ConfigError(f"experiment.arms[{i}].weight must be >= 0, got {arm.weight}")
    if config.experiment.arms and not any(a.weight > 0 for a in config.experiment.arms):
        raise ConfigError("experiment.arms: at least one weight must be > 0")
    # Building each policy once checks its name and params with the registry's own message.
    for key, name, params in _configured_policies(config):
        try:
            build_policy(name, params)
        except ValueError as exc:
            # An unknown name is the policy key's fault, anything else its parameters'.
            if name not in REGISTRY:
                where = key
            else:
                where = "policy.params" if key == "policy" else key.removesuffix(".policy") + ".params"
            raise ConfigError(f"{where}: {exc}") from None
    refuse_blind_policies(config)
    return config


def _configured_policies(config: RouterConfig) -> list[tuple[str, str, Mapping[str, Any]]]:
    """(config key, policy name, params) of the policy and of every experiment arm."""
    return [("policy", config.policy.name, config.policy.params)] + [
        (f"experiment.arms[{i}].policy", arm.policy, arm.params)
        for i, arm in enumerate(config.experiment.arms)
    ]


def refuse_blind_policies(config: RouterConfig) -> None:
    """ConfigError for a configured policy that would route blind (``_refuse_blind``). ``validate``
    calls it, and ``build_router_app`` for configs built in code."""
    import policies  # noqa: F401  (registers the built-in policies)
    from policies.base import REGISTRY

    for key, name, _ in _configured_policies(config):
        if name in REGISTRY:
            _refuse_blind(config, key, name, REGISTRY)


def _refuse_blind(config: RouterConfig, key: str, name: str, registry: Mapping[str, Any]) -> None:
    """Refuse a policy that matches prompt blocks (index, approx_prefix) when the config gives it
    none. Refused, not warned: such a router starts and serves, but every cache-aware decision is
    made on zero predicted hits, which looks like a working router with a bad policy."""
    factory = registry[name]
    if needs_block_keys(factory) and config.tokenizer.backend == "none":
        keyless = ", ".join(sorted(n for n, f in registry.items() if not needs_block_keys(f)))
        raise ConfigError(
            f'{key} "{name}" matches prompt blocks, but tokenizer.backend = "none" gives it no '
            "tokens to match: it would route blind. Set [tokenizer] backend to "
            '"hf" with path = the model\'s tokenizer directory (tokenizer.json + chat template), '
            '"engine" (the engines\' POST /tokenize) or "sim" (simulated engines only); '
            f"or use a policy that needs no tokens: {keyless}"
        )
    if getattr(factory, "uses_index", False) and not config.index.enabled:
        no_index = ", ".join(sorted(n for n, f in registry.items() if not getattr(f, "uses_index", False)))
        raise ConfigError(
            f'{key} "{name}" reads the prefix index, but index.enabled = false: it would see no '
            f"cached blocks. Set index.enabled = true or use a policy that does not read it: {no_index}"
        )


_DEBUG_ACCESS = ("", "open", "api_key", "admin", "off")
_TENANCY_SOURCES = ("auto", "none", "api_key", "header")


def _validate_limits_auth(config: RouterConfig) -> None:
    limits, health = config.limits, config.health
    if limits.first_byte_timeout_s < 0:
        raise ConfigError(
            "limits.first_byte_timeout_s must be >= 0 (0 = from the measured TTFT), "
            f"got {limits.first_byte_timeout_s}"
        )
    if limits.drain_timeout_s < 0:
        raise ConfigError(f"limits.drain_timeout_s must be >= 0 (0 = no bound), got {limits.drain_timeout_s}")
    if not limits.client_write_timeout_s >= 0:  # (NaN too)
        raise ConfigError(
            f"limits.client_write_timeout_s must be >= 0 (0 = no bound), got {limits.client_write_timeout_s}"
        )
    for key in (
        "header_timeout_s",
        "body_timeout_s",
        "max_header_bytes",
        "max_headers",
        "session_map_bytes",
    ):
        if getattr(limits, key) <= 0:
            raise ConfigError(f"limits.{key} must be positive, got {getattr(limits, key)}")
    for key in ("max_prompt_tokens", "max_connections"):
        if getattr(limits, key) < 0:
            raise ConfigError(f"limits.{key} must be >= 0 (0 = no limit), got {getattr(limits, key)}")
    if config.tokenizer.cache_max_bytes < 0:
        raise ConfigError(f"tokenizer.cache_max_bytes must be >= 0, got {config.tokenizer.cache_max_bytes}")
    tok = config.tokenizer
    if (
        tok.parity_tail_tokens < 0
        or tok.parity_window < 1
        or not 1 <= tok.parity_min_mismatches <= tok.parity_window
    ):
        raise ConfigError(
            "tokenizer parity needs parity_tail_tokens >= 0 and 1 <= parity_min_mismatches <= parity_window; "
            f"got parity_tail_tokens {tok.parity_tail_tokens}, parity_min_mismatches "
            f"{tok.parity_min_mismatches}, parity_window {tok.parity_window}"
        )
    for key in ("failures_before_unhealthy", "breaker_failures"):
        if getattr(health, key) < 1:
            raise ConfigError(f"health.{key} must be >= 1, got {getattr(health, key)}")
    for key in ("answer_liveness_s", "breaker_open_s"):
        if getattr(health, key) < 0:
            raise ConfigError(f"health.{key} must be >= 0, got {getattr(health, key)}")
    auth = config.auth
    if auth.debug_access not in _DEBUG_ACCESS:
        raise ConfigError(
            f"auth.debug_access {auth.debug_access!r} unknown; accepted: open, api_key, admin, off "
            '(or "" for the mode\'s default)'
        )
    for key, tenant in auth.api_keys.items():
        if not key or not isinstance(tenant, str) or not tenant:
            raise ConfigError(
                f"auth.api_keys maps non-empty keys to non-empty tenant names; got a key -> {tenant!r}"
            )
    if auth.max_failures_per_minute < 1:
        raise ConfigError(f"auth.max_failures_per_minute must be >= 1, got {auth.max_failures_per_minute}")
    for proxy in auth.trusted_proxies:
        try:
            ipaddress.ip_network(proxy, strict=False)
        except ValueError:
            raise ConfigError(
                f"auth.trusted_proxies: {proxy!r} is not an IP address or CIDR range (e.g. 10.0.0.0/8)"
            ) from None
    tenancy = config.tenancy
    if tenancy.source not in _TENANCY_SOURCES:
        raise ConfigError(
            f"tenancy.source {tenancy.source!r} unknown; accepted: {', '.join(_TENANCY_SOURCES)}"
        )
    if tenancy.source == "api_key" and not auth.api_keys:
        raise ConfigError('tenancy.source "api_key" needs auth.api_keys')
    if tenancy.source == "header" and not tenancy.header:
        raise ConfigError('tenancy.source "header" needs tenancy.header (a header name)')


def _validate_index_events_costs(config: RouterConfig) -> None:
    from kvcore.calibration import CostModel

    index = config.index
    if index.storage_pool_blocks <= 0:
        raise ConfigError(f"index.storage_pool_blocks must be positive, got {index.storage_pool_blocks}")
    for pool_id, blocks in index.pools.items():
        if not isinstance(blocks, int) or blocks <= 0:
            raise ConfigError(f"index.pools.{pool_id} must be a positive block count, got {blocks!r}")
    if index.speculation_ttl_s < 0:
        raise ConfigError(f"index.speculation_ttl_s must be >= 0 (0 disables), got {index.speculation_ttl_s}")
    if config.events.silent_after_s <= 0 or config.events.replay_timeout_s <= 0:
        raise ConfigError("events.silent_after_s and events.replay_timeout_s must be positive")
    if not config.costs.priority_step_s > 0:
        raise ConfigError(f"costs.priority_step_s must be positive, got {config.costs.priority_step_s}")
    try:
        check_priority_stretch(config.costs.priority_stretch, "costs.priority_stretch")
        check_priority_max_overtake(config.costs.priority_max_overtake_s, "costs.priority_max_overtake_s")
        check_priority_fcfs_factor(config.costs.priority_fcfs_factor, "costs.priority_fcfs_factor")
        check_priority_fcfs_factor(
            config.costs.priority_recompute_fcfs_factor, "costs.priority_recompute_fcfs_factor"
        )
        check_recompute_below(config.costs.priority_recompute_below, "costs.priority_recompute_below")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    escalate_s = config.costs.priority_escalate_after_s
    if not (escalate_s >= 0 and math.isfinite(escalate_s)):
        raise ConfigError(f"costs.priority_escalate_after_s must be >= 0 seconds (0 = off), got {escalate_s}")
    if config.costs.priority_escalate_pick not in ESCALATE_PICKS:
        raise ConfigError(
            f"costs.priority_escalate_pick must be one of {', '.join(ESCALATE_PICKS)},"
            f" got {config.costs.priority_escalate_pick!r}"
        )
    pools = {e.storage_pool for e in config.engines if e.storage_pool}
    for pool, bandwidth in config.costs.storage_pool_bandwidth.items():
        if pool not in pools:
            raise ConfigError(
                f"costs.storage_pool_bandwidth names pool {pool!r}, which no engine mounts"
                f" (engines[].storage_pool: {', '.join(sorted(pools)) or 'none set'})"
            )
        try:
            check_pool_bandwidth(bandwidth, f"costs.storage_pool_bandwidth.{pool}")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if config.costs.scrape_interval_s < 0:
        raise ConfigError(
            f"costs.scrape_interval_s must be >= 0 (0 disables), got {config.costs.scrape_interval_s}"
        )
    try:
        CostModel.from_config(config.costs.priors)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"costs.priors: {exc}") from None
    shared = config.shared
    if shared.redis_url and urlsplit(shared.redis_url).scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(
            f"shared.redis_url {shared.redis_url!r} must be redis://host:port/db, rediss://... or unix://..."
        )
    for key in ("ttl_s", "timeout_s", "retention_s"):
        if not getattr(shared, key) > 0:
            raise ConfigError(f"shared.{key} must be positive, got {getattr(shared, key)}")
    if config.trace.block_tokens <= 0:
        raise ConfigError(f"trace.block_tokens must be positive, got {config.trace.block_tokens}")
    for i, engine in enumerate(config.engines):
        if config.trace.path and config.trace.block_tokens % engine.block_size:
            raise ConfigError(
                f"trace.block_tokens ({config.trace.block_tokens}) must be a multiple of "
                f"engines[{i}].block_size ({engine.block_size})"
            )


def load_config(
    path: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    fleet_file: str | Path | None = None,
) -> RouterConfig:
    """Defaults < TOML file ``path`` < env (``KVROUTE_*``) < ``overrides`` (from CLI flags, same
    nested shape as the file). ``fleet_file`` (or the ``fleet_file`` key) appends its engines."""
    data: dict[str, Any] = {}
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(
                f"config file {path} not found; pass an existing TOML file to --config"
            ) from None
        except IsADirectoryError:
            raise ConfigError(f"config file {path} is a directory; pass a TOML file to --config") from None
        except OSError as exc:
            raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"config file {path} is not UTF-8 text (byte {exc.object[exc.start : exc.start + 1]!r} "
                f"at offset {exc.start}); TOML files must be UTF-8"
            ) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    data = _deep_merge(data, env_layer(os.environ if environ is None else environ))
    if overrides:
        data = _deep_merge(data, overrides)
    if fleet_file:
        data["fleet_file"] = str(fleet_file)
    config = _convert(data)
    if config.fleet_file:
        config.engines = [*config.engines, *load_fleet_file(config.fleet_file)]
    if not config.engines:
        raise ConfigError(
            "no engines configured: add [[engines]] to the config file, --fleet FILE, "
            "--engine id=url or KVROUTE_ENGINES"
        )
    return validate(config)


def load_fleet_file(path: str | Path) -> list[EngineConfig]:
    """Engines listed in a fleet file: JSON ``{"version": 1, "engines": [EngineConfig fields...]}``."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"fleet file {path} cannot be read: {exc}") from None
    try:
        doc = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ConfigError(f"fleet file {path} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("engines"), list):
        raise ConfigError(f'fleet file {path} must be an object with an "engines" list')
    if doc.get("version", FLEET_FILE_VERSION) != FLEET_FILE_VERSION:
        raise ConfigError(
            f"fleet file {path} has version {doc.get('version')}; this router reads "
            f"version {FLEET_FILE_VERSION}"
        )
    try:
        return msgspec.convert(doc["engines"], list[EngineConfig])
    except msgspec.ValidationError as exc:
        raise ConfigError(
            f"fleet file {path}: {exc}; accepted engine keys: {_accepted(EngineConfig)}"
        ) from None


def write_fleet_file(path: str | Path, engines: Sequence[EngineConfig]) -> None:
    """Write ``engines`` as a fleet file (atomically: readers never see half a file)."""
    target = Path(path)
    doc = {"version": FLEET_FILE_VERSION, "engines": list(engines)}
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(doc), indent=2) + b"\n")
    os.replace(tmp, target)
