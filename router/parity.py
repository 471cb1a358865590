"""Tokenizer parity, checked live: for every answered request the router compares its own prompt
token count with the engine's ``usage.prompt_tokens``. A persistent mismatch means the router's
block keys are not the engine's, so every prefix lookup on that engine is blind: it becomes a
metric, a ``/ready`` warning, distrust of that engine's index, and one log line with the likely cause.

What agreement to expect: the router tokenises exactly what the engine does (the same chat template
with its generation prompt, no special tokens added), so with the same tokenizer both counts are
equal. ``tail_tokens`` tolerates a template that differs only by a few tokens (a BOS added to a
completion prompt, an assistant header); a difference that shifts the start of the prompt cannot be
told from one at its end by a count, and the index's self-check is what catches that.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from router.routing import RouteContext

log = logging.getLogger("kvroute.parity")


@dataclass(slots=True)
class _EngineParity:
    #: (router's count, engine's count, whether they mismatch) of the last ``window`` answered
    #: requests (the verdict kept: a sample leaving the window is not judged again).
    samples: deque[tuple[int, int, bool]]
    matched_total: int = 0
    mismatched_total: int = 0
    #: Why the engine's index is distrusted ("" = it is not).
    reason: str = ""
    last_difference: int = 0
    #: How many of ``samples`` are mismatches (kept as samples come and go: no scan per request).
    bad_in_window: int = 0


class PromptParity:
    """Per engine, the last ``window`` (router, engine) prompt token counts. An engine turns
    mismatched when at least ``min_mismatches`` of them differ by more than ``tail_tokens``, and
    trusted again when ``window`` requests in a row agree. A ``RouteObserver`` (on_finished)."""

    def __init__(self, *, tail_tokens: int = 8, window: int = 8, min_mismatches: int = 4) -> None:
        if tail_tokens < 0 or window < 1 or not 1 <= min_mismatches <= window:
            raise ValueError(
                f"prompt parity: need tail_tokens >= 0 and 1 <= min_mismatches <= window, got "
                f"{tail_tokens}, {min_mismatches}, {window}"
            )
        self.tail_tokens = tail_tokens
        self.window = window
        self.min_mismatches = min_mismatches
        self._engines: dict[str, _EngineParity] = {}
        #: The engines whose ``reason`` is set (read per engine and request by the index's trust
        #: check: a set lookup, no call; written here only, with ``reason``).
        self.distrusted_ids: set[str] = set()

    def _mismatch(self, router_tokens: int, engine_tokens: int) -> bool:
        return abs(engine_tokens - router_tokens) > self.tail_tokens

    def observe(self, engine_id: str, router_tokens: int, engine_tokens: int) -> None:
        """One answered request: the router counted ``router_tokens``, the engine ``engine_tokens``."""
        state = self._engines.get(engine_id)
        if state is None:
            state = self._engines[engine_id] = _EngineParity(deque(maxlen=self.window))
        samples = state.samples
        if len(samples) == samples.maxlen and samples[0][2]:
            state.bad_in_window -= 1  # the oldest sample leaves the window with this append
        mismatch = self._mismatch(router_tokens, engine_tokens)
        samples.append((router_tokens, engine_tokens, mismatch))
        state.last_difference = engine_tokens - router_tokens
        if mismatch:
            state.mismatched_total += 1
            state.bad_in_window += 1
        else:
            state.matched_total += 1
        if not state.reason and state.bad_in_window >= self.min_mismatches:
            bad = [(r, e) for r, e, mismatched in samples if mismatched]
            state.reason = (
                f"the engine's usage.prompt_tokens differs from the router's own count on {len(bad)} of "
                f"the last {len(state.samples)} requests (latest: router {router_tokens}, engine "
                f"{engine_tokens}); {likely_cause(bad)}; its prefix index is not trusted until "
                f"{self.window} requests in a row agree"
            )
            self.distrusted_ids.add(engine_id)
            log.warning("engine %s: tokenizer parity lost: %s", engine_id, state.reason)
        elif state.reason and not state.bad_in_window and len(samples) == self.window:
            log.info("engine %s: tokenizer parity restored (%d requests agree)", engine_id, self.window)
            state.reason = ""
            self.distrusted_ids.discard(engine_id)

    def distrusts(self, engine_id: str) -> bool:
        return engine_id in self.distrusted_ids

    def distrusted(self) -> set[str]:
        """Engines whose prompt counts persistently disagree with the router's: their index is blind."""
        return set(self.distrusted_ids)

    def ready_detail(self) -> dict[str, str]:
        """Engine id -> why its prompt tokens disagree (the ``/ready`` warning)."""
        return {engine_id: s.reason for engine_id, s in self._engines.items() if s.reason}

    def collect(self) -> list[Any]:
        """``kvroute_prompt_token_checks_total{engine,result}``, ``kvroute_prompt_token_mismatch{engine}``
        (1 = distrusted) and ``kvroute_prompt_token_difference{engine}`` (engine minus router, last)."""
        checks = CounterMetricFamily(
            "kvroute_prompt_token_checks",
            "Answered requests whose engine prompt token count was compared with the router's",
            labels=["engine", "result"],
        )
        mismatch = GaugeMetricFamily(
            "kvroute_prompt_token_mismatch",
            "1 when the engine's prompt token counts persistently disagree with the router's tokenizer",
            labels=["engine"],
        )
        difference = GaugeMetricFamily(
            "kvroute_prompt_token_difference",
            "Engine's usage.prompt_tokens minus the router's count, last answered request",
            labels=["engine"],
        )
        for engine_id, s in sorted(self._engines.items()):
            checks.add_metric([engine_id, "match"], s.matched_total)
            checks.add_metric([engine_id, "mismatch"], s.mismatched_total)
            mismatch.add_metric([engine_id], 1 if s.reason else 0)
            difference.add_metric([engine_id], s.last_difference)
        return [checks, mismatch, difference]

    # -- RouteObserver ----------------------------------------------------------------------------

    def on_routed(self, ctx: RouteContext) -> None:
        pass

    def on_first_byte(self, ctx: RouteContext) -> None:
        pass

    def on_finished(self, ctx: RouteContext) -> None:
        if not ctx.ok or ctx.prompt_token_ids is None or not ctx.engine_id:
            return  # no answer, or the router did not tokenise this request
        engine_tokens = (ctx.usage or {}).get("prompt_tokens")
        if type(engine_tokens) is int:  # (not a bool; the usage is JSON-decoded: no subclasses)
            self.observe(ctx.engine_id, len(ctx.prompt_token_ids), engine_tokens)


def likely_cause(samples: list[tuple[int, int]]) -> str:
    """A guess at why (router, engine) counts differ, from their pattern."""
    router_counts = {r for r, _ in samples}
    engine_counts = {e for _, e in samples}
    differences = {e - r for r, e in samples}
    if len(router_counts) == 1 and len(engine_counts) > 1:
        return (
            f"the router's count stays at {next(iter(router_counts))} while the engine's varies: the "
            "router's tokenizer truncates or pads (truncation/padding stored in tokenizer.json?)"
        )
    if len(differences) == 1:
        d = next(iter(differences))
        return (
            f"the engine counts {abs(d)} {'more' if d > 0 else 'fewer'} tokens on every request: the "
            "chat templates differ (a BOS, a default system prompt, the generation prompt); check "
            "tokenizer_config.json's chat_template against the engine's --chat-template"
        )
    ratio = sum(e for _, e in samples) / max(1, sum(r for r, _ in samples))
    return (
        f"the engine counts {ratio:.2f} tokens per router token: a different tokenizer (check "
        'tokenizer.path, or use tokenizer.backend = "engine")'
    )
