"""A/B experiments: arms of (policy, params, weight), sticky per conversation, with per-arm statistics.

Assignment hashes the session key into weight buckets, so it is the same after a restart and on every
router replica; sessions already seen keep their arm across ``reload``. ``report()`` is the body of
``GET /v1/experiments``: per arm, TTFT percentiles (streamed requests), the hit rate from the
engines' reported cached tokens, the index's predicted tier split (labelled predicted), and
cluster-bootstrap intervals (conversations resampled) of the differences to the control arm.
"""

from __future__ import annotations

import copy
import math
import operator
import random
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvcore.stats import ConversationTotals, cluster_bootstrap_diff, hit_rate, mean_ttft, percentiles
from policies.base import TIERS, Policy, build_policy

#: Memory of one remembered session (int digest key, shared arm name, ordered-dict node), measured
#: with tracemalloc on CPython 3.11.
SESSION_ENTRY_BYTES = 144
#: Header whose value forces an arm for one request (for tests and manual comparisons).
FORCED_ARM_HEADER = "x-kvroute-arm"
#: The digest of a session key (xxh3_64 of its UTF-8): the key of its remembered arm and of its
#: conversation's totals, and (scaled) its bucket. Hashed where needed: a one-entry cache of the
#: last key missed at any concurrency (a request's finish rarely follows its own assignment).
_hash = xxhash.xxh3_64_intdigest


@dataclass(frozen=True, slots=True)
class ArmConfig:
    """One arm as configured."""

    name: str
    policy: str
    params: Mapping[str, Any] = field(default_factory=dict)
    weight: float = 1.0


@dataclass(slots=True)
class Arm:
    """A live arm: its config and its policy object."""

    name: str
    policy_name: str
    params: Mapping[str, Any]
    weight: float
    policy: Policy


def parse_experiment_config(raw: Any) -> list[ArmConfig]:
    """Arms from config: ``{"policy": name, "params": {...}}`` (one arm named after the policy),
    ``{"arms": [...]}`` or a list of ``{"name", "policy", "params", "weight"}``."""
    if isinstance(raw, str):
        raw = {"policy": raw}
    if isinstance(raw, Mapping) and "arms" not in raw:
        if "policy" not in raw:
            raise ValueError("experiment config needs 'policy' (one arm) or 'arms' (a list of arms)")
        raw = [{"name": raw.get("name", raw["policy"]), **raw}]
    elif isinstance(raw, Mapping):
        raw = raw["arms"]
    if not isinstance(raw, Sequence) or not raw:
        raise ValueError("experiment 'arms' must be a non-empty list of {name, policy, params, weight}")
    arms: list[ArmConfig] = []
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping) or "policy" not in item:
            raise ValueError(f"experiment arm #{i} needs a 'policy' key, got {item!r}")
        unknown = set(item) - {"name", "policy", "params", "weight"}
        if unknown:
            raise ValueError(
                f"experiment arm #{i}: unknown keys {sorted(unknown)}; accepted: name, policy, params, weight"
            )
        weight = float(item.get("weight", 1.0))
        if not weight >= 0 or math.isinf(weight):
            raise ValueError(f"experiment arm #{i}: weight must be a finite number >= 0, got {weight}")
        arms.append(
            ArmConfig(
                str(item.get("name", item["policy"])),
                str(item["policy"]),
                dict(item.get("params") or {}),
                weight,
            )
        )
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"experiment arm names must be unique, got {names}")
    if sum(a.weight for a in arms) <= 0:
        raise ValueError("experiment arms: at least one weight must be > 0")
    return arms


def session_bucket(session_key: str) -> float:
    """Uniform position in [0, 1) of a session key; stable across processes and replicas."""
    return _bucket_of(_hash(session_key.encode()))


def _bucket_of(digest: int) -> float:
    """``session_bucket`` of the key whose digest this is."""
    return digest / 2.0**64


@dataclass(slots=True)
class ArmStats:
    """One arm's counters, a bounded uniform reservoir of TTFTs (Vitter's algorithm R) for the
    percentiles, and per-conversation totals (the clusters of the confidence intervals)."""

    reservoir_size: int
    max_conversations: int
    rng: random.Random
    requests: int = 0
    errors: int = 0
    #: Successful requests with a measured TTFT (streams) / without (non-stream answers).
    ttft_seen: int = 0
    no_ttft: int = 0
    ttft_samples_s: list[float] = field(default_factory=list)
    #: Successful requests whose engine reported usage (cached tokens and prompt tokens).
    usage_reported: int = 0
    cached_tokens: float = 0.0
    usage_prompt_tokens: float = 0.0
    #: The index's predicted hits of the chosen engine by tier (a prediction, not a measurement).
    predicted_hit_tokens_by_tier: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    prompt_tokens: float = 0.0
    #: digest of the session key -> [ttft_sum_s, ttft_count, cached_tokens, prompt_tokens] (keys
    #: are client-chosen strings of any size); conversations past ``max_conversations`` count in
    #: the totals but not in the intervals.
    conversations: dict[int, list[float]] = field(default_factory=dict)

    def add_ttft(self, ttft_s: float) -> None:
        self.ttft_seen += 1
        if len(self.ttft_samples_s) < self.reservoir_size:
            self.ttft_samples_s.append(ttft_s)
        else:
            slot = self.rng.randrange(self.ttft_seen)
            if slot < self.reservoir_size:
                self.ttft_samples_s[slot] = ttft_s

    def conversation(self, digest: int) -> list[float] | None:
        """The totals row of the conversation whose session key has this digest (``_hash``)."""
        row = self.conversations.get(digest)
        if row is None and len(self.conversations) < self.max_conversations:
            row = self.conversations[digest] = [0.0, 0.0, 0.0, 0.0]
        return row

    def clusters(self) -> list[ConversationTotals]:
        return [ConversationTotals(r[0], int(r[1]), r[2], r[3]) for r in self.conversations.values()]


class Experiments:
    """Arms, sticky assignment and per-arm statistics. The first arm is the control."""

    def __init__(
        self,
        config: Any,
        *,
        reservoir_size: int = 10_000,
        max_sessions: int = 250_000,
        max_conversations_per_arm: int = 100_000,
        bootstrap_resamples: int = 2000,
        confidence: float = 0.95,
        seed: int = 0,
        policy_factory: Callable[[str, Mapping[str, Any]], Policy] = build_policy,
    ) -> None:
        self._reservoir_size = reservoir_size
        self._max_conversations = max_conversations_per_arm
        self._resamples = bootstrap_resamples
        self._max_sessions = max_sessions
        self._confidence = confidence
        self._seed = seed
        self._policy_factory = policy_factory
        self._stats: dict[str, ArmStats] = {}
        # Digest of each session seen -> arm name; a bounded LRU of fixed-size entries (the keys are
        # client-chosen strings of any length: a 1 MB ``user`` must not be kept whole).
        self._sessions: OrderedDict[int, str] = OrderedDict()
        self.arms: list[Arm] = []
        self._by_name: dict[str, Arm] = {}
        self._bounds: list[float] = []
        self._install(parse_experiment_config(config))

    def _install(self, configs: list[ArmConfig]) -> None:
        old = {a.name: a for a in self.arms}
        arms = []
        for c in configs:
            prev = old.get(c.name)
            if prev is not None and prev.policy_name == c.policy and dict(prev.params) == dict(c.params):
                policy = prev.policy  # keep learned state (e.g. approx_prefix's memory)
            else:
                policy = self._policy_factory(c.policy, c.params)
            arms.append(Arm(c.name, c.policy, dict(c.params), c.weight, policy))
        total = sum(a.weight for a in arms)
        bounds, acc = [], 0.0
        for a in arms:
            acc += a.weight / total
            bounds.append(acc)
        bounds[-1] = 1.0
        self.arms, self._bounds = arms, bounds
        self._by_name = {a.name: a for a in arms}
        for i, a in enumerate(arms):
            if a.name not in self._stats:
                self._stats[a.name] = ArmStats(
                    self._reservoir_size, self._max_conversations, random.Random(f"{self._seed}:{i}:{a.name}")
                )

    def arm(self, name: str) -> Arm:
        """The arm called ``name``; ValueError listing the accepted names otherwise."""
        for a in self.arms:
            if a.name == name:
                return a
        raise ValueError(f"unknown experiment arm {name!r}; accepted: {', '.join(a.name for a in self.arms)}")

    def assign(self, session_key: str, forced_arm: str | None = None) -> Arm:
        """The arm of a conversation: the forced one (header value), the one it had, or its hash bucket."""
        if forced_arm:
            return self.arm(forced_arm)
        digest = _hash(session_key.encode())
        known = self._sessions.get(digest)
        if known is not None:
            self._sessions.move_to_end(digest)
            arm = self._by_name.get(known)
            if arm is not None:
                return arm
        bucket = _bucket_of(digest)
        chosen = self.arms[-1]
        for a, bound in zip(self.arms, self._bounds, strict=True):
            if bucket < bound and a.weight > 0:
                chosen = a
                break
        self._sessions[digest] = chosen.name
        while len(self._sessions) > self._max_sessions:
            self._sessions.popitem(last=False)
        return chosen

    def bound_sessions(self, max_bytes: int) -> None:
        """Keep about ``max_bytes`` of session -> arm entries (SESSION_ENTRY_BYTES each)."""
        self._max_sessions = max(1, max_bytes // SESSION_ENTRY_BYTES)

    def session_count(self) -> int:
        return len(self._sessions)

    #: ``assign`` without a forced arm: router.routing's ArmSelector protocol (name, policy). The
    #: same function, not a wrapper (one call less per request).
    select = assign

    def record_turn(
        self,
        arm: str,
        session_key: str,
        *,
        ok: bool,
        ttft_s: float | None,
        cached_tokens: int | None,
        prompt_tokens: int,
        predicted_hit_tokens_by_tier: Sequence[float] = (0.0, 0.0, 0.0),
    ) -> None:
        """Account one finished turn to its arm and conversation (``kvcore.core.ExperimentRecorder``).
        ``ttft_s`` only for streamed requests; ``cached_tokens`` as the engine reported it."""
        stats = self._stats.get(arm)
        if stats is None:
            raise ValueError(f"unknown experiment arm {arm!r}")
        stats.requests += 1
        if not ok:
            stats.errors += 1
            return
        row = stats.conversation(_hash(session_key.encode()))
        if ttft_s is not None and math.isfinite(ttft_s):
            stats.add_ttft(ttft_s)
            if row is not None:
                row[0] += ttft_s
                row[1] += 1
        else:
            stats.no_ttft += 1
        if cached_tokens is not None:
            stats.usage_reported += 1
            stats.cached_tokens += cached_tokens
            stats.usage_prompt_tokens += prompt_tokens
            if row is not None:
                row[2] += cached_tokens
                row[3] += prompt_tokens
        totals = stats.predicted_hit_tokens_by_tier  # per tier (``TIERS`` order), added in C
        totals[:] = map(operator.add, totals, predicted_hit_tokens_by_tier)
        stats.prompt_tokens += prompt_tokens

    def reload(self, new_config: Any) -> None:
        """Switch to new arms; sessions already seen keep their arm while it still exists."""
        self._install(parse_experiment_config(new_config))
        live = {a.name for a in self.arms}
        for session in [s for s, name in self._sessions.items() if name not in live]:
            del self._sessions[session]

    def snapshot(self) -> tuple[list[Arm], dict[str, ArmStats]]:
        """A copy of the arms and their statistics, for ``report`` off the event loop."""
        return list(self.arms), copy.deepcopy(self._stats)

    def report(self, snapshot: tuple[list[Arm], dict[str, ArmStats]] | None = None) -> dict[str, Any]:
        """Per-arm statistics and conversation-level intervals of the differences to the first
        (control) arm: mean TTFT (streamed turns) and hit rate (engine-reported cached tokens)."""
        arms, stats = snapshot if snapshot is not None else (self.arms, self._stats)
        control = arms[0].name
        control_clusters = stats[control].clusters()
        control_ttfts = stats[control].ttft_samples_s
        live = {a.name: a for a in arms}
        arms_out = []
        for name in [*live, *(n for n in stats if n not in live)]:
            s = stats[name]
            arm = live.get(name)
            p50, p90, p99 = percentiles(s.ttft_samples_s, (50, 90, 99))
            ok = s.requests - s.errors
            predicted = sum(s.predicted_hit_tokens_by_tier)
            entry: dict[str, Any] = {
                "name": name,
                "policy": arm.policy_name if arm else None,
                "weight": arm.weight if arm else 0.0,
                "active": arm is not None,
                "requests": s.requests,
                "errors": s.errors,
                "conversations": len(s.conversations),
                "ttft_samples": len(s.ttft_samples_s),
                "requests_without_ttft": s.no_ttft,
                "ttft_p50_s": _none_if_nan(p50),
                "ttft_p90_s": _none_if_nan(p90),
                "ttft_p99_s": _none_if_nan(p99),
                "ttft_mean_s": sum(s.ttft_samples_s) / len(s.ttft_samples_s) if s.ttft_samples_s else None,
                "requests_with_usage": s.usage_reported,
                "hit_rate": s.cached_tokens / s.usage_prompt_tokens if s.usage_prompt_tokens > 0 else None,
                "predicted": {
                    "note": "the router's index prediction for the chosen engine, not engine-reported",
                    "mean_hit_tokens": {
                        t.name.lower(): (s.predicted_hit_tokens_by_tier[t] / ok if ok else None)
                        for t in TIERS
                    },
                    "hit_rate": predicted / s.prompt_tokens if s.prompt_tokens > 0 else None,
                },
            }
            if name != control:
                clusters = s.clusters()
                ttft_ci = cluster_bootstrap_diff(
                    control_clusters,
                    clusters,
                    mean_ttft,
                    confidence=self._confidence,
                    resamples=self._resamples,
                )
                hit_ci = cluster_bootstrap_diff(
                    control_clusters,
                    clusters,
                    hit_rate,
                    confidence=self._confidence,
                    resamples=self._resamples,
                )
                c50 = percentiles(control_ttfts, (50,))[0]
                entry["vs_control"] = {
                    "control": control,
                    "median_diff_s": _none_if_nan(p50 - c50),
                    "mean_ttft_diff_s": ttft_ci.diff if ttft_ci else None,
                    "mean_ttft_diff_ci_s": [ttft_ci.low, ttft_ci.high] if ttft_ci else None,
                    "hit_rate_diff": hit_ci.diff if hit_ci else None,
                    "hit_rate_diff_ci": [hit_ci.low, hit_ci.high] if hit_ci else None,
                    "conversations": [len(control_clusters), len(clusters)],
                    "confidence": self._confidence,
                    "method": "cluster bootstrap over conversations (percentile interval)",
                }
            arms_out.append(entry)
        return {"control": control, "arms": arms_out}


def _none_if_nan(value: float) -> float | None:
    return None if math.isnan(value) else value
