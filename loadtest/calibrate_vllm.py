"""Fit the engine model's time parameters (sim/engine.py) to real engines.

Sends controlled streaming requests straight to each engine of a fleet file (not through a router):
prompts of several lengths made unique by a random prefix (so nothing is cached), one request at a
time for the prefill terms, then ``n`` concurrent streams for the decode terms. Measured per request:
TTFT (the prefill step) and the gaps between streamed tokens (one decode step each). The step model

    step_s = step_overhead_s + prefill_tokens / prefill_tokens_per_s
             + prefill_attention_s_per_token_ctx * sum over prefill tokens of their context
             + decoding_requests * decode_s_per_seq
             + decode context tokens * kv_bytes_per_token / hbm_bytes_per_s

is linear in (step_overhead_s, 1 / prefill_tokens_per_s, prefill_attention_s_per_token_ctx,
decode_s_per_seq, kv_bytes_per_token / hbm_bytes_per_s): one least-squares fit (numpy) over both
kinds of samples, constrained to non-negative coefficients. Prints the parameters and the residuals,
writes a JSON engine profile ``kvroute sim --engine-profile`` reads.

    python -m loadtest.calibrate_vllm --fleet fleet.json --out runs/calib/profile.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openai

from kvcore.stats import percentiles
from router.config import load_fleet_file
from sim.engine import EngineProfile
from sim.frontend import ServerStage

#: The coefficients, in column order of the design matrix.
COEFFICIENTS = (
    "request_overhead_s",
    "step_overhead_s",
    "prefill_s_per_token",
    "prefill_attention_s_per_token_ctx",
    "decode_s_per_seq",
    "decode_s_per_ctx_token",
)

#: vLLM's step token budget (max_num_batched_tokens) for its OpenAI server on CPU (vLLM 0.32
#: engine/arg_utils.py: 2,048 x world size); a longer prompt's prefill takes several steps.
VLLM_CPU_STEP_TOKENS = 2048

#: vLLM 0.32's max_num_seqs for its OpenAI server on CPU (engine/arg_utils.py).
VLLM_CPU_MAX_NUM_SEQS = 128

#: Words the prompts are made of (the engines' BPE tokenizer splits them into a few tokens each;
#: lengths are taken from the engine's ``usage.prompt_tokens``, not from this text).
_WORDS = "the cache router sends every turn of a conversation to the engine that holds its prefix".split()


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One uncached prompt of ``prompt_tokens`` run alone: its TTFT is one prefill step."""

    prompt_tokens: int
    ttft_s: float


@dataclass(frozen=True, slots=True)
class DecodeSample:
    """One decode step of ``batch`` requests reading ``context_tokens`` of KV in total."""

    batch: int
    context_tokens: int
    step_s: float


@dataclass(frozen=True, slots=True)
class Fit:
    coefficients: dict[str, float]
    #: Relative residuals (measured / fitted - 1) of the prefill and of the decode samples.
    prefill_residuals: list[float]
    decode_residuals: list[float]

    def profile_fields(self, kv_bytes_per_token: int) -> dict[str, float]:
        """The fit as EngineProfile fields (a zero per-token cost becomes an infinite rate)."""
        c = self.coefficients
        return {
            "step_overhead_s": c["step_overhead_s"],
            "prefill_tokens_per_s": 1.0 / c["prefill_s_per_token"]
            if c["prefill_s_per_token"] > 0
            else math.inf,
            "prefill_attention_s_per_token_ctx": c["prefill_attention_s_per_token_ctx"],
            "decode_s_per_seq": c["decode_s_per_seq"],
            "hbm_bytes_per_s": (
                kv_bytes_per_token / c["decode_s_per_ctx_token"]
                if c["decode_s_per_ctx_token"] > 0
                else math.inf
            ),
        }


def design_rows(
    prefill: Sequence[PrefillSample], decode: Sequence[DecodeSample], step_tokens: int = VLLM_CPU_STEP_TOKENS
) -> tuple[np.ndarray, np.ndarray]:
    """The least-squares system: one row per sample, columns in COEFFICIENTS order. A prefill of P
    tokens from an empty context attends to sum_{i<P} i = P (P - 1) / 2 context tokens, in
    ceil(P / step_tokens) chunked-prefill steps (each pays the step overhead). A TTFT also
    pays ``request_overhead_s`` once (the API server's HTTP, chat template, tokenization and
    detokenization: outside the engine core's steps, so not an EngineProfile field)."""
    rows = [
        [1.0, math.ceil(p / step_tokens), p, p * (p - 1) / 2, 0.0, 0.0]
        for p in (s.prompt_tokens for s in prefill)
    ]
    rows += [[0.0, 1.0, 0.0, 0.0, float(s.batch), float(s.context_tokens)] for s in decode]
    times = [s.ttft_s for s in prefill] + [s.step_s for s in decode]
    return np.array(rows, dtype=float), np.array(times, dtype=float)


def fit_step_model(
    prefill: Sequence[PrefillSample], decode: Sequence[DecodeSample], step_tokens: int = VLLM_CPU_STEP_TOKENS
) -> Fit:
    """Least squares with non-negative coefficients (active set: the most negative coefficient is
    fixed at 0 and the rest refitted, until none is negative). Columns are scaled to unit norm
    first: the attention column is ~1e6 times the others."""
    if len(prefill) < 3 or len(decode) < 3:
        raise ValueError(f"need >= 3 prefill and >= 3 decode samples, got {len(prefill)} and {len(decode)}")
    if len({s.prompt_tokens for s in prefill}) < 3:
        raise ValueError("prefill samples need >= 3 distinct prompt lengths (linear + quadratic terms)")
    if len({s.batch for s in decode}) < 2:
        raise ValueError("decode samples need >= 2 distinct batch sizes (per-sequence vs fixed step cost)")
    a, y = design_rows(prefill, decode, step_tokens)
    # Relative error: weight each row by 1 / its time, so short decode steps count as much as prefills.
    w = 1.0 / np.maximum(y, 1e-9)
    aw, yw = a * w[:, None], y * w
    norms = np.linalg.norm(aw, axis=0)
    norms[norms == 0] = 1.0
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while True:
        sol, *_ = np.linalg.lstsq(aw[:, active] / norms[active], yw, rcond=None)
        sol = sol / norms[active]
        if (sol >= 0).all():
            x[:] = 0.0
            x[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    fitted = a @ x
    rel = (y / np.maximum(fitted, 1e-12) - 1.0).tolist()
    return Fit(
        coefficients=dict(zip(COEFFICIENTS, (float(v) for v in x), strict=True)),
        prefill_residuals=rel[: len(prefill)],
        decode_residuals=rel[len(prefill) :],
    )


# ------------------------------------------------------------------------------ measuring


def prompt_text(num_words: int) -> str:
    """A prompt no engine has seen: a random tag first, so its first block (and every block after)
    hashes differently from any earlier prompt's."""
    return uuid.uuid4().hex + " " + " ".join(_WORDS[i % len(_WORDS)] for i in range(num_words))


@dataclass(slots=True)
class StreamResult:
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    #: Arrival of every chunk after the first, relative to the request's start. A chunk may carry
    #: more than one token (a random-weight model emits tokens that detokenize to nothing).
    chunk_times_s: list[float]

    def step_s(self, start_s: float, end_s: float) -> tuple[float, int] | None:
        """Mean decode step between ``start_s`` and ``end_s`` (relative times) and the number of
        tokens generated by the middle of that window, estimated from the chunks arriving in it
        (tokens per chunk = completion tokens / chunks). None if fewer than 3 chunks fall in it."""
        inside = [t for t in self.chunk_times_s if start_s <= t <= end_s]
        if len(inside) < 3:
            return None
        tokens_per_chunk = (self.completion_tokens - 1) / max(1, len(self.chunk_times_s))
        steps = (len(inside) - 1) * tokens_per_chunk
        if steps <= 0:
            return None
        mid_chunk = self.chunk_times_s.index(inside[len(inside) // 2]) + 1
        return (inside[-1] - inside[0]) / steps, round(mid_chunk * tokens_per_chunk)


def stream_once(client: openai.OpenAI, model: str, text: str, max_tokens: int) -> StreamResult:
    """One streaming chat completion of exactly ``max_tokens`` tokens (EOS ignored).

    TTFT is taken at the first chunk with choices: vLLM sends it (the assistant role, empty text)
    when the engine's first output token arrives. The first TEXT can come several tokens later: a
    random-weights model emits byte tokens that do not complete a UTF-8 character, and vLLM's
    detokenizer holds them back (seen here: role chunk at 0.05 s, first text at 0.17 s)."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "min_tokens": max_tokens},
        temperature=0.0,
    )
    times: list[float] = []
    prompt_tokens = completion_tokens = 0
    for chunk in stream:
        if chunk.choices:
            times.append(time.perf_counter() - t0)
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
            completion_tokens = chunk.usage.completion_tokens
    if not times or not prompt_tokens:
        raise RuntimeError(
            f"stream returned no tokens or no usage (chunks {len(times)}, usage {prompt_tokens})"
        )
    return StreamResult(prompt_tokens, completion_tokens, times[0], times[1:])


def measure_prefill(
    client: openai.OpenAI, model: str, word_counts: Sequence[int], repeats: int
) -> list[PrefillSample]:
    samples = []
    for _ in range(repeats):
        for words in word_counts:
            r = stream_once(client, model, prompt_text(words), max_tokens=1)
            samples.append(PrefillSample(r.prompt_tokens, r.ttft_s))
    return samples


def concurrent_streams(
    client: openai.OpenAI, model: str, n: int, words: int, max_tokens: int
) -> tuple[list[float], list[StreamResult]]:
    """``n`` streams started at once (one thread each): their start times and results."""
    results: list[StreamResult | BaseException] = [RuntimeError("not run")] * n
    starts = [0.0] * n

    def run(i: int) -> None:
        starts[i] = time.perf_counter()
        try:
            results[i] = stream_once(client, model, prompt_text(words), max_tokens)
        except BaseException as exc:  # re-raised below, in the caller's thread
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return starts, [r for r in results if isinstance(r, StreamResult)]


def measure_decode(
    client: openai.OpenAI, model: str, batches: Sequence[int], words: int, max_tokens: int
) -> list[DecodeSample]:
    """``n`` concurrent streams per batch size; the steps measured while all ``n`` are decoding
    (after the last first token, before the first stream ends) are steps of ``n`` decodes. One
    sample per stream: its mean step over that window, at its middle context."""
    samples: list[DecodeSample] = []
    for n in batches:
        starts, done = concurrent_streams(client, model, n, words, max_tokens)
        # Relative to the first start: the window where all n streams are decoding.
        firsts = [st - starts[0] + r.ttft_s for st, r in zip(starts, done, strict=True)]
        lasts = [
            st - starts[0] + (r.chunk_times_s[-1] if r.chunk_times_s else r.ttft_s)
            for st, r in zip(starts, done, strict=True)
        ]
        lo, hi = max(firsts), min(lasts)
        for st, r in zip(starts, done, strict=True):
            got = r.step_s(lo - (st - starts[0]), hi - (st - starts[0]))
            if got is None:
                continue
            step, generated = got
            # n requests, each with about its prompt + generated tokens of KV.
            samples.append(DecodeSample(n, n * (r.prompt_tokens + generated), step))
    return samples


@dataclass(frozen=True, slots=True)
class LoadedRequest:
    """One request of a closed-loop run at ``concurrency`` streams (the front-end calibration)."""

    concurrency: int
    engine: str
    prompt_tokens: int
    completion_tokens: int
    start_s: float
    ttft_s: float
    end_s: float
    #: "direct" (straight to the engine) or "router" (through a round_robin kvroute).
    via: str = "direct"


def loaded_run(
    clients: Sequence[tuple[str, openai.OpenAI]],
    model: str,
    concurrency: int,
    per_stream: int,
    words: Sequence[int],
    max_tokens: int,
    think_s: float,
    via: str = "direct",
) -> list[LoadedRequest]:
    """``concurrency`` closed-loop streams, each sending ``per_stream`` uncached requests in turn
    (prompt sizes cycling through ``words``; ``think_s`` between them), dealt round robin over
    ``clients`` (engine id, client). Times are relative to the run's start."""
    out: list[LoadedRequest] = []
    lock = threading.Lock()
    sent = [0]
    t_run = time.perf_counter()

    def stream(i: int) -> None:
        for k in range(per_stream):
            with lock:
                engine, client = clients[sent[0] % len(clients)]
                sent[0] += 1
            t0 = time.perf_counter() - t_run
            r = stream_once(client, model, prompt_text(words[(i + k) % len(words)]), max_tokens)
            end = r.chunk_times_s[-1] if r.chunk_times_s else r.ttft_s
            with lock:
                out.append(
                    LoadedRequest(
                        concurrency, engine, r.prompt_tokens, r.completion_tokens, t0, r.ttft_s, end, via
                    )
                )
            time.sleep(think_s)

    run_threads(concurrency, stream, "front-end request streams")
    return out


def run_threads(n: int, target: Callable[[int], None], what: str) -> None:
    """``target(i)`` on ``n`` threads; after all end, RuntimeError if any raised (a thread that
    raises stops only itself)."""
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} {what} failed; first: {errors[0]!r}")


# ------------------------------------------------------------------------------ server stages


def replay_loaded(
    loaded: Sequence[LoadedRequest],
    engine_ids: Sequence[str],
    profile: EngineProfile,
    api: ServerStage | None,
    router: ServerStage | None,
) -> list[float]:
    """The DES's TTFT of every request in ``loaded`` (same order): each run (via, concurrency) on a
    fresh fleet of ``engine_ids`` with ``profile``; each request a one-turn conversation of its own
    blocks (nothing cached) sent at its measured time and dealt round robin in send order, as the
    calibration dealt them (straight, or through a round_robin router: ``router`` applies to those)."""
    from sim.des import FleetSimulator, SimConfig
    from sim.fleets import EngineSpec, FleetSpec
    from sim.workloads import Conversation, Turn, Workload

    out: dict[int, float] = {}
    runs: dict[tuple[str, int], list[int]] = {}
    for i, r in enumerate(loaded):
        runs.setdefault((r.via, r.concurrency), []).append(i)
    bs = profile.block_size
    for (via, _), idx in runs.items():
        idx.sort(key=lambda i: loaded[i].start_s)
        convs = [
            Conversation(
                f"r{i}",
                [
                    Turn(
                        loaded[i].prompt_tokens,
                        max(1, loaded[i].completion_tokens),
                        [i * 100_000 + b for b in range(loaded[i].prompt_tokens // bs)],
                        at_s=0.0,
                    )
                ],
                start_s=loaded[i].start_s,
            )
            for i in idx
        ]
        fleet = FleetSpec(
            [EngineSpec(e, dataclasses.replace(profile)) for e in engine_ids],
            api_server=api,
            router_stage=router if via == "router" else None,
        )
        res = FleetSimulator(
            Workload("loaded", bs, convs),
            "round_robin",
            fleet,
            SimConfig(scrape_interval_s=0, track_ideal=False),
        ).run()
        for i in idx:
            out[i] = res.ttft_by_request_s[f"r{i}#0"]
    return [out[i] for i in range(len(loaded))]


def _log_error(sim: Sequence[float], live: Sequence[float]) -> float:
    """Mean squared log ratio (a TTFT twice too long costs as much as one half too short)."""
    return float(
        np.mean(
            [(math.log(max(a, 1e-9)) - math.log(max(b, 1e-9))) ** 2 for a, b in zip(sim, live, strict=True)]
        )
    )


def _golden(f: Any, lo: float, hi: float, iters: int = 24) -> float:
    """The minimum of ``f`` on [lo, hi] by golden-section search (``f`` unimodal there)."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


def _coordinate_fit(
    f: Any,
    x0: list[float],
    bounds: list[tuple[float, float]],
    passes: int = 3,
    *,
    clip_second_to_first: bool = False,
    grid: int = 8,
) -> list[float]:
    """Minimise ``f(x)`` one coordinate at a time, ``passes`` times: a scan of ``grid`` points over
    the coordinate's bounds (replayed TTFTs jump where two requests swap places, so the error is not
    unimodal) and a golden-section search between the best point's neighbours.
    ``clip_second_to_first``: x[1] <= x[0] as well."""
    x = list(x0)
    for _ in range(passes):
        for j, (lo, hi) in enumerate(bounds):
            if clip_second_to_first and j == 1:
                hi = min(hi, x[0])

            def at(v: float, j: int = j) -> float:
                return float(f([*x[:j], v, *x[j + 1 :]]))

            points = sorted({lo + (hi - lo) * i / (grid - 1) for i in range(grid)} | {min(max(x[j], lo), hi)})
            errors = [at(v) for v in points]
            best = int(np.argmin(errors))
            left, right = points[max(best - 1, 0)], points[min(best + 1, len(points) - 1)]
            v = _golden(at, left, right, iters=16)
            x[j] = v if at(v) <= errors[best] else points[best]
    return x


@dataclass(frozen=True, slots=True)
class StageFit:
    api_server: ServerStage
    router_stage: ServerStage | None
    #: Mean squared log ratio DES / live TTFT over the straight and the routed requests.
    api_error: float
    router_error: float


def fit_server_stages(
    loaded: Sequence[LoadedRequest],
    engine_ids: Sequence[str],
    profile: EngineProfile,
    max_request_s: float = 0.5,
    max_output_s_per_token: float = 0.05,
    *,
    noise: bool = True,
) -> StageFit:
    """Fit the API-server stage to the straight front-end runs, then the router stage to the routed
    ones with the API server fixed: the values with which the DES, replaying each run's requests at
    their measured send times, gives their measured TTFTs (least squares on log TTFT, a coordinate
    search). Each stage's per-request time is split into work that holds the process (``request_s``:
    requests queue behind it) and a stall that does not (``stall_s``): the runs at several
    concurrencies tell them apart. ``noise``: then the stall's ``stall_sigma`` is set so that the
    replayed TTFTs' tail (p90 / p50) is the measured one's (the API server's on the straight runs,
    the router's on the routed ones, with the API server's noise in). ``profile``: the engine core's
    fitted step model (its prefill rate also carries the API server's per-token tokenization, which
    one request at a time cannot tell apart from prefill)."""
    direct = [r for r in loaded if r.via == "direct"]
    routed = [r for r in loaded if r.via == "router"]
    if len({r.concurrency for r in direct}) < 2:
        raise ValueError("the API-server fit needs straight front-end runs at >= 2 concurrencies")

    # Searched as (a, o, f): a = what one request alone pays on the way in and for its first token
    # (request_s + stall_s + output_s_per_token; the one-stream runs pin it), o = output_s_per_token,
    # f = the share of the rest that holds the process (request_s = f (a - o), stall_s = (1 - f)(a - o)).
    def stage(x: Sequence[float]) -> ServerStage:
        rest = max(0.0, x[0] - x[1])
        return ServerStage(request_s=x[2] * rest, output_s_per_token=x[1], stall_s=(1.0 - x[2]) * rest)

    def search(err: Any) -> list[float]:
        return _coordinate_fit(
            err,
            [0.01, 0.0, 0.5],
            [(0.0, max_request_s), (0.0, max_output_s_per_token), (0.0, 1.0)],
            clip_second_to_first=True,
        )

    def fit(runs: Sequence[Any], replay: Callable[[ServerStage], Sequence[Any]]) -> tuple[ServerStage, float]:
        """One stage fitted to ``runs`` (``replay(stage)`` = the DES's replay with that stage in
        place), its log error, and with ``noise`` its stall's sigma matched to their tail."""
        live = [r.ttft_s for r in runs]

        def err(x: Sequence[float]) -> float:
            return _log_error(replay(stage(x)), live)

        x = search(err)
        fitted = stage(x)
        if noise:
            fitted = dataclasses.replace(fitted, stall_sigma=_tail_sigma(replay, fitted, live))
        return fitted, err(x)

    api, api_error = fit(direct, lambda sg: replay_loaded(direct, engine_ids, profile, sg, None))
    if not routed:
        return StageFit(api, None, api_error, math.nan)
    router, router_error = fit(routed, lambda sg: replay_loaded(routed, engine_ids, profile, api, sg))
    return StageFit(api, router, api_error, router_error)


def _tail_sigma(replay: Any, stage: ServerStage, live: Sequence[float], grid: int = 21) -> float:
    """The stall sigma (0 to 2, on a grid) with which the replayed TTFTs' p90 / p50 is the measured
    one's: the fitted medians leave the tail to the stalls. ``replay(stage)`` -> TTFTs (seeded)."""
    p50, p90 = percentiles(live, (50, 90))
    want = math.log(p90 / p50)
    best, best_err = 0.0, math.inf
    for i in range(grid):
        sigma = 2.0 * i / (grid - 1)
        sim = replay(dataclasses.replace(stage, stall_sigma=sigma))
        s50, s90 = percentiles(sim, (50, 90))
        err = abs(math.log(s90 / s50) - want)
        if err < best_err:
            best, best_err = sigma, err
    return best


def median_samples(
    prefill: Sequence[PrefillSample], decode: Sequence[DecodeSample]
) -> tuple[list[PrefillSample], list[DecodeSample]]:
    """One sample per prompt size (lengths within 32 tokens of each other) and per batch size: the median time
    (and median size). A busy machine stalls the odd request by several times its time; the fit on
    medians is not dragged by them."""
    groups: list[list[PrefillSample]] = []
    for s in sorted(prefill, key=lambda s: s.prompt_tokens):
        if groups and s.prompt_tokens - groups[-1][-1].prompt_tokens <= 32:
            groups[-1].append(s)
        else:
            groups.append([s])
    by_batch: dict[int, list[DecodeSample]] = {}
    for d in decode:
        by_batch.setdefault(d.batch, []).append(d)
    return (
        [
            PrefillSample(
                int(statistics.median(s.prompt_tokens for s in g)), statistics.median(s.ttft_s for s in g)
            )
            for g in groups
        ],
        [
            DecodeSample(
                n, int(statistics.median(d.context_tokens for d in g)), statistics.median(d.step_s for d in g)
            )
            for n, g in by_batch.items()
        ],
    )


def kv_bytes_per_token(model_dir: Path | None) -> int | None:
    """Llama-style config.json: layers x KV heads x head dim x 2 (K and V) x 2 bytes (bf16)."""
    if model_dir is None or not (model_dir / "config.json").is_file():
        return None
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return int(cfg["num_hidden_layers"] * kv_heads * head_dim * 2 * 2)


def format_fit(
    fit: Fit, fields: dict[str, float], prefill: Sequence[PrefillSample], decode: Sequence[DecodeSample]
) -> str:
    lines = ["fitted step model:"]
    lines += [f"  {k:<36} {v:.6g}" for k, v in fit.coefficients.items()]
    lines.append("as EngineProfile fields:")
    lines += [f"  {k:<36} {v:.6g}" for k, v in fields.items()]
    lines.append("prefill samples (prompt tokens, TTFT s, residual measured/fitted-1):")
    lines += [
        f"  {s.prompt_tokens:>6} {s.ttft_s:8.4f} {r:+.3f}"
        for s, r in zip(prefill, fit.prefill_residuals, strict=True)
    ]
    lines.append("decode samples (batch, context tokens, step s, residual):")
    lines += [
        f"  {s.batch:>3} {s.context_tokens:>7} {s.step_s:8.5f} {r:+.3f}"
        for s, r in zip(decode, fit.decode_residuals, strict=True)
    ]
    for name, res in (("prefill", fit.prefill_residuals), ("decode", fit.decode_residuals)):
        lines.append(f"{name}: |residual| median {median_abs(res):.3f}, max {max(map(abs, res)):.3f}")
    lines += [f"WARNING: {w}" for w in fit_warnings(fit)]
    return "\n".join(lines)


#: A fit whose median |measured / fitted - 1| over a kind of sample is above this does not follow
#: those samples: its terms for them are not to be trusted.
MAX_MEDIAN_RESIDUAL = 0.5


def median_abs(residuals: Sequence[float]) -> float:
    """The (upper) median of the residuals' sizes."""
    sizes = sorted(abs(r) for r in residuals)
    return sizes[len(sizes) // 2]


def fit_warnings(fit: Fit) -> list[str]:
    """Why the fit's prefill or decode terms are unreliable, if they are (also written to the
    profile as ``fit_warnings``). Seen on vLLM's CPU build (round q36): its API server sends a
    stream's tokens in bursts, so the gaps between them are not decode steps."""
    out = []
    for name, res in (("prefill", fit.prefill_residuals), ("decode", fit.decode_residuals)):
        if not res:
            continue
        median = median_abs(res)
        if median > MAX_MEDIAN_RESIDUAL:
            cause = (
                " (streamed tokens that arrive in bursts are not one decode step apart)"
                if name == "decode"
                else ""
            )
            out.append(
                f"the {name} terms do not follow their samples: median |residual| {median:.2f} >"
                f" {MAX_MEDIAN_RESIDUAL}{cause}; the profile's {name} terms are unreliable"
            )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.calibrate_vllm", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--fleet", type=Path, help="fleet file (kvroute fleet --fleet-file)")
    p.add_argument(
        "--from-raw",
        type=Path,
        help="fit the samples of an earlier --raw-out instead of measuring (no fleet)",
    )
    p.add_argument(
        "--gpu-blocks", type=int, default=400, help="the engines' --num-gpu-blocks-override (stage fit)"
    )
    p.add_argument("--engine", help="engine id to calibrate (default: the fleet's first)")
    p.add_argument("--model-dir", type=Path, help="the engines' model folder (for kv_bytes_per_token)")
    p.add_argument(
        "--prompt-words", default="50,300,700,1200,1700,2200", help="prefill prompt sizes, in words"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="prefill samples per prompt size; from 3 on, the fit uses each size's median",
    )
    p.add_argument("--batches", default="1,1,1,2,2,2,4,4,4", help="decode: concurrent streams per run")
    p.add_argument("--decode-words", type=int, default=300)
    p.add_argument("--decode-tokens", type=int, default=400, help="tokens per decode stream")
    p.add_argument(
        "--step-tokens", type=int, default=VLLM_CPU_STEP_TOKENS, help="the engines' max_num_batched_tokens"
    )
    p.add_argument(
        "--frontend-concurrency",
        default="1,2,4",
        help="front-end stage: closed-loop runs at these numbers of concurrent streams over all the "
        "fleet's engines ('' = skip)",
    )
    p.add_argument("--frontend-requests", type=int, default=6, help="requests per stream per run")
    p.add_argument("--frontend-words", default="300,700,1200,1700", help="front-end prompt sizes, in words")
    p.add_argument("--frontend-tokens", type=int, default=32, help="answer tokens per front-end request")
    p.add_argument(
        "--router-model-dir",
        type=Path,
        help="also run the front-end runs through a round_robin kvroute serve "
        "(--tokenizer hf on this folder)",
    )
    p.add_argument("--raw-out", type=Path, help="write every raw sample here (JSON)")
    p.add_argument("--out", type=Path, help="write the profile JSON here")
    args = p.parse_args(argv)
    try:
        words = [int(w) for w in args.prompt_words.split(",")]
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError as exc:
        p.error(f"--prompt-words / --batches: comma-separated integers ({exc})")
    if min(words) < 1 or min(batches) < 1 or args.repeats < 1 or args.decode_tokens < 8:
        p.error("--prompt-words, --batches, --repeats must be >= 1 and --decode-tokens >= 8")
    if args.from_raw is not None:
        try:
            raw = json.loads(args.from_raw.read_text())
            prefill = [PrefillSample(**x) for x in raw["prefill"]]
            decode = [DecodeSample(**x) for x in raw["decode"]]
            loaded = [LoadedRequest(**x) for x in raw["loaded"]]
            engine_ids, measured_on = list(raw["engines"]), dict(raw["measured_on"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            p.error(f"--from-raw {args.from_raw}: {exc}")
    else:
        if args.fleet is None:
            p.error("--fleet is required (or --from-raw)")
        engines = load_fleet_file(args.fleet)
        if not engines:
            p.error(f"{args.fleet}: no engines")
        engine = next((e for e in engines if e.id == args.engine), None) if args.engine else engines[0]
        if engine is None:
            p.error(f"--engine {args.engine!r} is not in {args.fleet} ({', '.join(e.id for e in engines)})")
        prefill, decode, loaded = measure(args, engines, engine, words, batches)
        engine_ids = [e.id for e in engines]
        measured_on = {"engine": engine.id, "url": engine.url, "block_size": engine.block_size or 32}
        if args.raw_out:
            args.raw_out.parent.mkdir(parents=True, exist_ok=True)
            raw = {
                "prefill": [dataclasses.asdict(x) for x in prefill],
                "decode": [dataclasses.asdict(x) for x in decode],
                "loaded": [dataclasses.asdict(x) for x in loaded],
                "engines": engine_ids,
                "measured_on": measured_on,
                "load": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
            }
            args.raw_out.write_text(json.dumps(raw, indent=1) + "\n")
    if args.repeats >= 3:
        prefill, decode = median_samples(prefill, decode)
    fit = fit_step_model(prefill, decode, args.step_tokens)
    kvb = kv_bytes_per_token(args.model_dir) or EngineProfile.kv_bytes_per_token
    fields = fit.profile_fields(kvb)
    print(format_fit(fit, fields, prefill, decode))
    doc: dict[str, Any] = {
        "engine_profile": {
            "kv_bytes_per_token": kvb,
            "max_num_batched_tokens": args.step_tokens,
            "max_num_seqs": VLLM_CPU_MAX_NUM_SEQS,
            **fields,
        },
        "request_overhead_s": fit.coefficients["request_overhead_s"],
        "measured_on": measured_on,
        "residuals": {"prefill": fit.prefill_residuals, "decode": fit.decode_residuals},
        "fit_warnings": fit_warnings(fit),
    }
    if len({r.concurrency for r in loaded if r.via == "direct"}) >= 2:
        profile = EngineProfile(
            **doc["engine_profile"],
            block_size=int(measured_on.get("block_size") or 32),
            num_gpu_blocks=args.gpu_blocks - 1,  # vLLM's override counts its null block
        )
        stages = fit_server_stages(loaded, engine_ids, profile)
        doc["api_server"] = dataclasses.asdict(stages.api_server)
        if stages.router_stage is not None:
            doc["router_stage"] = dataclasses.asdict(stages.router_stage)
        doc["stage_errors"] = {"api_server": stages.api_error, "router_stage": stages.router_error}
        print(format_stages(stages, loaded, engine_ids, profile))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


def format_stages(
    fit: StageFit, loaded: Sequence[LoadedRequest], engine_ids: Sequence[str], profile: EngineProfile
) -> str:
    """The fitted stages and, per front-end run, measured vs replayed TTFT medians."""
    lines = ["fitted server stages (sim/frontend.py):"]
    lines.append(f"  api_server   {fit.api_server}  (mean sq. log error {fit.api_error:.4f})")
    if fit.router_stage is not None:
        lines.append(f"  router_stage {fit.router_stage}  (mean sq. log error {fit.router_error:.4f})")
    sim = replay_loaded(loaded, engine_ids, profile, fit.api_server, fit.router_stage)
    bare = replay_loaded(loaded, engine_ids, profile, None, None)
    lines.append(
        "front-end runs (via, streams, requests, TTFT p50 measured / DES with stages / DES without):"
    )
    runs: dict[tuple[str, int], list[int]] = {}
    for i, r in enumerate(loaded):
        runs.setdefault((r.via, r.concurrency), []).append(i)
    for (via, c), idx in runs.items():
        med = [statistics.median(v[i] for i in idx) for v in ([r.ttft_s for r in loaded], sim, bare)]
        lines.append(f"  {via:<7} {c:>3} {len(idx):>4}   {med[0]:.4f} / {med[1]:.4f} / {med[2]:.4f}")
    return "\n".join(lines)


def measure(
    args: argparse.Namespace,
    engines: Sequence[Any],
    engine: Any,
    words: Sequence[int],
    batches: Sequence[int],
) -> tuple[list[PrefillSample], list[DecodeSample], list[LoadedRequest]]:
    """Every sample from the live fleet: prefills and decode steps on ``engine``, the front-end runs
    over all ``engines`` (and through a router with --router-model-dir)."""
    client = openai.OpenAI(
        base_url=f"{engine.url.rstrip('/')}/v1", api_key="unused", timeout=600, max_retries=0
    )
    model = engine.model or client.models.list().data[0].id
    print(f"calibrating {engine.id} at {engine.url} (model {model})", file=sys.stderr)
    stream_once(client, model, prompt_text(20), max_tokens=4)  # warm-up, not a sample
    prefill = measure_prefill(client, model, words, args.repeats)
    decode = measure_decode(client, model, batches, args.decode_words, args.decode_tokens)
    loaded: list[LoadedRequest] = []
    fe_conc = [int(c) for c in args.frontend_concurrency.split(",") if c.strip()]
    if not fe_conc:
        return prefill, decode, loaded
    fe_words = [int(w) for w in args.frontend_words.split(",")]
    clients = [
        (
            e.id,
            openai.OpenAI(base_url=f"{e.url.rstrip('/')}/v1", api_key="unused", timeout=600, max_retries=0),
        )
        for e in engines
    ]
    for c in fe_conc:
        loaded += loaded_run(clients, model, c, args.frontend_requests, fe_words, args.frontend_tokens, 0.05)
    if args.router_model_dir is not None:
        from loadtest.calib_compare import start_router
        from loadtest.procs import stop_process

        work = (args.raw_out or args.out or Path("runs/calib/x")).parent
        work.mkdir(parents=True, exist_ok=True)
        proc, url = start_router(args.fleet, args.router_model_dir, "round_robin", work / "router-calib.log")
        try:
            rclient = [
                ("", openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0))
            ]
            for c in fe_conc:
                loaded += loaded_run(
                    rclient, model, c, args.frontend_requests, fe_words, args.frontend_tokens, 0.05, "router"
                )
        finally:
            stop_process(proc)
    return prefill, decode, loaded


if __name__ == "__main__":
    raise SystemExit(main())
