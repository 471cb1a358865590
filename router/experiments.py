"""A/B experiments: arms of (policy, params, weight), sticky per conversation, with per-arm statistics.

Assignment hashes the session key into weight buckets, so it is the same after a restart and on every
router replica; sessions already seen keep their arm across ``reload``. ``report()`` is the body of
``GET /v1/experiments``: per-arm TTFT percentiles, hit tokens per tier, and a Welch CI vs. control.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from policies.base import TIERS, Policy, build_policy

#: Memory of one remembered session (int digest key, shared arm name, ordered-dict node), measured
#: with tracemalloc on CPython 3.11.
SESSION_ENTRY_BYTES = 144
#: Header whose value forces an arm for one request (for tests and manual comparisons).
FORCED_ARM_HEADER = "x-kvroute-arm"


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
    return xxhash.xxh3_64_intdigest(session_key.encode()) / 2.0**64


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of already-sorted values; nan when empty."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def t_quantile(p: float, df: float) -> float:
    """Student-t quantile by the Cornish-Fisher expansion around the normal (good to ~1% for df >= 3)."""
    z = _normal_quantile(p)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / df + g2 / df**2 + g3 / df**3


def _normal_quantile(p: float) -> float:
    # Acklam's rational approximation (relative error < 1.2e-9).
    a = (
        -3.969683028665376e01,
        2.209460984245205e02,
        -2.759285104469687e02,
        1.383577518672690e02,
        -3.066479806614716e01,
        2.506628277459239e00,
    )
    b = (
        -5.447609879822406e01,
        1.615858368580409e02,
        -1.556989798598866e02,
        6.680131188771972e01,
        -1.328068155288572e01,
    )
    c = (
        -7.784894002430293e-03,
        -3.223964580411365e-01,
        -2.400758277161838e00,
        -2.549732539343734e00,
        4.374664141464968e00,
        2.938163982698783e00,
    )
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00)
    if p < 0.02425:
        q = math.sqrt(-2 * math.log(p))
        return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / (
            (((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1
        )
    if p > 1 - 0.02425:
        return -_normal_quantile(1 - p)
    q = p - 0.5
    r = q * q
    return (
        (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5])
        * q
        / (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)
    )


def welch_interval(
    a: Sequence[float], b: Sequence[float], confidence: float = 0.95
) -> dict[str, float] | None:
    """CI of mean(b) - mean(a) by Welch's t; None with fewer than 2 samples on a side."""
    na, nb = len(a), len(b)
    if na < 2 or nb < 2:
        return None
    ma, mb = sum(a) / na, sum(b) / nb
    va = sum((x - ma) ** 2 for x in a) / (na - 1)
    vb = sum((x - mb) ** 2 for x in b) / (nb - 1)
    se2 = va / na + vb / nb
    diff = mb - ma
    if se2 == 0:
        return {"diff": diff, "low": diff, "high": diff, "df": float(na + nb - 2)}
    df = se2**2 / ((va / na) ** 2 / (na - 1) + (vb / nb) ** 2 / (nb - 1))
    half = t_quantile(0.5 + confidence / 2, df) * math.sqrt(se2)
    return {"diff": diff, "low": diff - half, "high": diff + half, "df": df}


@dataclass(slots=True)
class ArmStats:
    """Counters and a bounded uniform reservoir of TTFTs (Vitter's algorithm R) for one arm."""

    reservoir_size: int
    rng: random.Random
    requests: int = 0
    errors: int = 0
    ttft_seen: int = 0
    ttft_samples_s: list[float] = field(default_factory=list)
    hit_tokens_by_tier: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    prompt_tokens: float = 0.0

    def add_ttft(self, ttft_s: float) -> None:
        self.ttft_seen += 1
        if len(self.ttft_samples_s) < self.reservoir_size:
            self.ttft_samples_s.append(ttft_s)
        else:
            slot = self.rng.randrange(self.ttft_seen)
            if slot < self.reservoir_size:
                self.ttft_samples_s[slot] = ttft_s


class Experiments:
    """Arms, sticky assignment and per-arm statistics. The first arm is the control."""

    def __init__(
        self,
        config: Any,
        *,
        reservoir_size: int = 10_000,
        max_sessions: int = 250_000,
        confidence: float = 0.95,
        seed: int = 0,
        policy_factory: Callable[[str, Mapping[str, Any]], Policy] = build_policy,
    ) -> None:
        self._reservoir_size = reservoir_size
        self._max_sessions = max_sessions
        self._confidence = confidence
        self._seed = seed
        self._policy_factory = policy_factory
        self._stats: dict[str, ArmStats] = {}
        # Digest of each session seen -> arm name; a bounded LRU of fixed-size entries (the keys are
        # client-chosen strings of any length: a 1 MB ``user`` must not be kept whole).
        self._sessions: OrderedDict[int, str] = OrderedDict()
        self.arms: list[Arm] = []
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
        for i, a in enumerate(arms):
            if a.name not in self._stats:
                self._stats[a.name] = ArmStats(
                    self._reservoir_size, random.Random(f"{self._seed}:{i}:{a.name}")
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
        digest = xxhash.xxh3_64_intdigest(session_key.encode())
        known = self._sessions.get(digest)
        if known is not None:
            self._sessions.move_to_end(digest)
            for a in self.arms:
                if a.name == known:
                    return a
        bucket = session_bucket(session_key)
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

    def select(self, session_key: str) -> Arm:
        """``assign`` without a forced arm: fits router.routing's ArmSelector protocol (name, policy)."""
        return self.assign(session_key)

    def record(
        self,
        arm: Arm | str,
        ttft_s: float | None,
        ok: bool,
        hit_tokens_by_tier: Sequence[float] = (0.0, 0.0, 0.0),
        prompt_tokens: float = 0.0,
    ) -> None:
        """Account one finished request to its arm (TTFT only counts for successful requests)."""
        name = arm if isinstance(arm, str) else arm.name
        stats = self._stats.get(name)
        if stats is None:
            raise ValueError(f"unknown experiment arm {name!r}")
        stats.requests += 1
        if not ok:
            stats.errors += 1
            return
        if ttft_s is not None and math.isfinite(ttft_s):
            stats.add_ttft(ttft_s)
        for tier in TIERS:
            stats.hit_tokens_by_tier[tier] += (
                hit_tokens_by_tier[tier] if tier < len(hit_tokens_by_tier) else 0.0
            )
        stats.prompt_tokens += prompt_tokens

    def reload(self, new_config: Any) -> None:
        """Switch to new arms; sessions already seen keep their arm while it still exists."""
        self._install(parse_experiment_config(new_config))
        live = {a.name for a in self.arms}
        for session in [s for s, name in self._sessions.items() if name not in live]:
            del self._sessions[session]

    def report(self) -> dict[str, Any]:
        """Per-arm statistics and Welch CIs of the mean TTFT difference to the first (control) arm."""
        control = self.arms[0].name
        control_samples = self._stats[control].ttft_samples_s
        arms_out = []
        names = [a.name for a in self.arms] + [n for n in self._stats if n not in {a.name for a in self.arms}]
        for name in names:
            s = self._stats[name]
            arm = next((a for a in self.arms if a.name == name), None)
            values = sorted(s.ttft_samples_s)
            ok = s.requests - s.errors
            hits = sum(s.hit_tokens_by_tier)
            entry: dict[str, Any] = {
                "name": name,
                "policy": arm.policy_name if arm else None,
                "weight": arm.weight if arm else 0.0,
                "active": arm is not None,
                "requests": s.requests,
                "errors": s.errors,
                "ttft_samples": len(values),
                "ttft_p50_s": _none_if_nan(percentile(values, 50)),
                "ttft_p90_s": _none_if_nan(percentile(values, 90)),
                "ttft_p99_s": _none_if_nan(percentile(values, 99)),
                "ttft_mean_s": sum(values) / len(values) if values else None,
                "mean_hit_tokens": {
                    t.name.lower(): (s.hit_tokens_by_tier[t] / ok if ok else None) for t in TIERS
                },
                "hit_rate": hits / s.prompt_tokens if s.prompt_tokens > 0 else None,
            }
            if name != control:
                ci = welch_interval(control_samples, s.ttft_samples_s, self._confidence)
                control_sorted = sorted(control_samples)
                entry["vs_control"] = {
                    "control": control,
                    "median_diff_s": _none_if_nan(percentile(values, 50) - percentile(control_sorted, 50)),
                    "mean_diff_s": ci["diff"] if ci else None,
                    "mean_diff_ci_s": [ci["low"], ci["high"]] if ci else None,
                    "confidence": self._confidence,
                    "method": "welch_t",
                }
            arms_out.append(entry)
        return {"control": control, "arms": arms_out}


def _none_if_nan(value: float) -> float | None:
    return None if math.isnan(value) else value
