"""Router CPU per request without the network: where B3's CPU goes, split in two.

B3 (loadtest/bench_peers.py) measures the router's CPU per request over real sockets. This program
measures the same router, set up the same way (``build_router_app`` behind two zero-delay ``fast``
upstreams, its lifespan running: health polls, scrapes, event sources), with the network taken out
of the proxied path: each request goes into the guarded proxy (``app.proxy_app``, what the HTTP
protocol calls for POST /v1/chat/completions) as an in-memory exchange, and the router's upstream
client is swapped, after start-up, for one that hands back the upstream's answer to the same body from
memory (captured from it once). What is left is kvroute's own work per request - the guard, body reading
and validation, the session key, tokenising and the index (``+tok``), the policy, the reservation,
the priority and usage splices, the answer's head, metrics, observers, the due-call release - with
no socket read or write, no protocol callback and no event-loop wake-up.

So B3's CPU per request minus this figure is what the network path costs (the HTTP protocols on
both sides, the transports, the loop); the raw-Python reference proxy (B3's ``raw_proxy``) is what
that path costs with nothing else. Non-stream answers only. Figures are the main thread's CPU
(``time.thread_time``) over each repeat's requests, medians over interleaved repeats.

The harness keeps glibc's freed heap (``M_TRIM_THRESHOLD``, as ``--heap kept``): alone in its
process the router's few ~50 KB buffers of a 16K-token request are the heap's top, which glibc
hands back to the kernel after each request by default, so that every request faulted its pages in
again (~11 minor faults and 21-32 µs a request at 16K, 2026-12-05) where the served router does
not (60 faults in ~19,000 requests, c64 16K under wrk). ``--heap trim`` measures with glibc's
defaults (the figures before 2026-12-05). The table gives the minor page faults a request.

``--evict mem:KIB`` / ``code:N`` runs, before every request, a scan of a KIB KiB buffer (the data
caches emptied, as wrk's and the upstreams' time slices between two of the router's would) or N
rounds of unrelated pure-Python work (other code and objects through the caches and branch
predictors), or ``switch:N`` a round trip to a child process on the same core that runs that work
N times (0: none) before it answers, and times each request on its own, so the figure is the
router's own work with its caches cold; ``--evict none`` is the control (the same per-request
timing, nothing run between).

    python -m loadtest.bench_split --targets round_robin,tier_cost+tok --prompt-tokens 1000,16000
    python -m loadtest.bench_split --targets round_robin --prompt-tokens 1000 --evict mem:4096
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import ctypes
import fractions
import os
import resource
import statistics
import sys
import tempfile
import textwrap
import time
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench_peers import FAST_MODEL, chat_body, refuse_distrusted, zero_delay_engines
from router.config import load_config
from router.service import build_router_app


class MemoryExchange:
    """One request's client side in memory, in the role of kvroute's own exchange
    (router/fastpath.py): the whole body handed over at once, the answer's ASGI messages kept,
    a disconnect hook that never fires."""

    __slots__ = ("_body", "messages", "more_body")

    #: The exchange's loop (None: the disconnect watcher asks for the running one, as before the
    #: live exchange kept its own) and why the router cut it (never).
    loop = None
    cut_reason = ""

    def __init__(self, body: bytes) -> None:
        self._body = body
        self.more_body = False
        self.messages: list[dict[str, Any]] = []

    def complete_body(self) -> bytes:
        return self._body

    async def receive(self) -> dict[str, Any]:
        return {"type": "http.request", "body": self._body, "more_body": False}

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)

    def disconnect_watcher(self, callback: Any) -> bool:
        return False  # the client is never gone


class MemoryAnswer:
    """An engine's whole answer, from memory (the attributes the router reads of a response)."""

    __slots__ = ("_body", "content_type", "status")

    done = True  # the whole answer is in (``UpstreamResponse.done``)

    def __init__(self, status: int, content_type: bytes, body: bytes) -> None:
        self.status, self.content_type, self._body = status, content_type, body

    async def read(self) -> bytes:
        return self._body

    def close(self) -> None:
        pass

    def release(self) -> None:
        pass


class MemoryUpstream:
    """In the role of ``router.proxy.UpstreamClient`` for non-stream requests: every send answers
    ``answer`` (the engine's answer to the body being measured) at once; counts the sends."""

    def __init__(self, answer: MemoryAnswer) -> None:
        self.answer = answer
        self.sent = 0

    async def send(self, url: str, body: bytes, headers: bytes, **_: Any) -> MemoryAnswer:
        self.sent += 1
        return self.answer


def _scope(body: bytes) -> dict[str, Any]:
    return {
        "type": "http",
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }


def evictor(spec: str) -> Callable[[], object]:
    """``none``: nothing (the control: the same per-request timing); ``mem:KIB``: a scan of a KIB
    KiB buffer (every cache line read once: clean lines, no write-back left for the router to pay);
    ``code:N``: N rounds of unrelated pure-Python work (text wrapping, URL parsing, fractions);
    ``switch:N``: a round trip through a pipe to a child process pinned to this thread's core,
    which runs ``code:N`` (N may be 0) before it answers: two context switches and another
    process's work on the core, as the upstreams' and wrk's time slices between the router's."""
    if spec == "none":
        return lambda: None
    kind, _, size = spec.partition(":")
    n = int(size) if size.isdigit() else -1
    if kind not in ("mem", "code", "switch") or n < (0 if kind == "switch" else 1):
        raise ValueError(
            f"--evict {spec!r}: expected none, mem:KIB, code:N or switch:N with a positive number"
        )
    if kind == "mem":
        buf = bytearray(b"\x5a" * (n * 1024))

        def scan() -> object:
            return buf.find(0)  # memchr over every cache line; read only, so none is left dirty

        return scan
    work = _python_work(n)
    if kind == "code":
        return work
    return _switcher(work)


def _python_work(n: int) -> Callable[[], object]:
    text = " ".join(f"word{i} {i * 7 % 13}" for i in range(8))
    url = "http://user@example.org:8080/a/b;p?q=1&r=two#frag"

    def work() -> object:
        out: object = None
        for i in range(n):
            out = (
                textwrap.wrap(text, 30 + i % 7),
                urllib.parse.parse_qs(urllib.parse.urlsplit(url).query),
                fractions.Fraction(i + 1, 7) + fractions.Fraction(3, i + 2),
            )
        return out

    return work


def _switcher(work: Callable[[], object]) -> Callable[[], object]:
    """Pins this thread to one core and forks a child pinned to it that answers each byte after
    ``work()``; the child exits when the pipe closes (at exit, or when this process dies)."""
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    from_parent, to_child = os.pipe()
    from_child, to_parent = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no cleanup of the parent's runs here (os._exit)
        os.close(to_child)
        os.close(from_child)
        try:
            while os.read(from_parent, 1):
                work()
                os.write(to_parent, b"x")
        finally:
            os._exit(0)
    os.close(from_parent)
    os.close(to_parent)

    def stop() -> None:
        os.close(to_child)
        os.waitpid(pid, 0)
        os.close(from_child)

    atexit.register(stop)

    def switch() -> object:
        os.write(to_child, b"x")
        return os.read(from_child, 1)

    return switch


#: glibc's mallopt parameter: the free heap top above which it is given back to the kernel.
M_TRIM_THRESHOLD = -1
KEPT_HEAP_BYTES = 32 * 1024 * 1024


def glibc() -> bool:
    """Whether this process runs on glibc (whose malloc ``keep_heap`` tunes)."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (AttributeError, ValueError, OSError):
        return False


def keep_heap() -> bool:
    """glibc's malloc told to keep up to 32 MiB of freed heap in this process (the module's
    docstring says why); False where there is no glibc (the figures then say how many faults)."""
    if not glibc():
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(M_TRIM_THRESHOLD, KEPT_HEAP_BYTES))
    except (AttributeError, OSError):
        return False


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


async def _measure(
    app: Any,
    body: bytes,
    requests: int,
    evict: Callable[[], object] | None = None,
    counter: Any = None,
    faults: list[float] | None = None,
) -> float:
    """CPU µs per request over ``requests`` requests (each answered 200, or it raises); the minor
    page faults a request appended to ``faults`` (the process's, all threads). With
    ``evict``, it runs before each request and each request is timed on its own (two clock reads
    per request, the same with ``evict`` = ``none``), so the eviction's own time is not in the
    figure; ``counter`` (loadtest/count_calls.py's ``CallCounter``) counts the Python run from the
    first request to the last answer (this loop's own lines included: the caller leaves out this
    file's functions)."""
    proxy, scope = app.proxy_app, _scope(body)
    if counter is not None:
        counter.start()
    clock = time.thread_time
    faulted = _minor_faults()
    started = clock()
    spent = 0.0
    for _ in range(requests):
        exchange = MemoryExchange(body)
        if evict is not None:
            evict()
            one = clock()
            await proxy(scope, exchange.receive, exchange.send)
            spent += clock() - one
        else:
            await proxy(scope, exchange.receive, exchange.send)
        status = exchange.messages[0].get("status") if exchange.messages else None
        if status != 200:
            raise RuntimeError(f"the router answered {status}: {exchange.messages[-1:]}")
    if evict is None:
        spent = clock() - started
    if faults is not None:
        faults.append((_minor_faults() - faulted) / requests)
    if counter is not None:
        counter.stop()
    return spent / requests * 1e6


async def _run_target(
    policy: str,
    tokenizer: bool,
    engines: Sequence[Any],
    answers: dict[int, MemoryAnswer],
    bodies: dict[int, bytes],
    requests: int,
    evict: Callable[[], object] | None = None,
    counter: Any = None,
    faults: dict[int, list[float]] | None = None,
) -> dict[int, float]:
    config = load_config(
        environ={},
        overrides={
            "engines": [{"id": e.id, "url": e.url, "model": e.model} for e in engines],
            "policy": {"name": policy},
            "tokenizer": {"backend": "sim" if tokenizer else "none"},
            "log_level": "warning",
        },
    )
    app = build_router_app(config)
    out: dict[int, float] = {}
    async with app.router.lifespan_context(app):
        router = app.state.router
        real, memory = router.client, MemoryUpstream(answers[next(iter(answers))])
        router.client = memory
        try:
            for prompt, body in bodies.items():
                memory.answer = answers[prompt]
                # Warm-up: caches filled, as in B3, and past the deferred accounting's queue of 256
                # finished requests (drained when full here), so the heap has grown to its size.
                await _measure(app, body, max(300, requests // 10))
                out[prompt] = await _measure(
                    app,
                    body,
                    requests,
                    evict,
                    counter,
                    None if faults is None else faults.setdefault(prompt, []),
                )
        finally:
            router.client = real
        if memory.sent < len(bodies) * requests:
            raise RuntimeError(f"only {memory.sent} requests reached the upstream")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            refuse_distrusted((await client.get("/ready")).json(), policy + ("+tok" if tokenizer else ""))
    return out


def _capture(url: str, body: bytes) -> MemoryAnswer:
    resp = httpx.post(
        f"{url}/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    resp.raise_for_status()
    content_type = resp.headers.get("content-type", "application/json").encode("latin-1")
    return MemoryAnswer(200, content_type, resp.content)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--targets", default="round_robin,tier_cost+tok", help="POLICY[+tok], comma-separated"
    )
    parser.add_argument("--prompt-tokens", default="1000,16000", help="comma-separated prompt sizes")
    parser.add_argument("--requests", type=int, default=3000, help="requests per target, size and repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--evict",
        default=None,
        metavar="none|mem:KIB|code:N|switch:N",
        help="before every request, cold caches; each request timed on its own (none: the control)",
    )
    parser.add_argument(
        "--heap",
        choices=("kept", "trim"),
        default="kept",
        help="kept: glibc keeps freed heap, as in the served router (default); trim: glibc's defaults",
    )
    args = parser.parse_args(argv)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    prompts = [int(p) for p in args.prompt_tokens.split(",") if p.strip()]
    if args.requests < 1 or args.repeats < 1 or not targets or not prompts:
        parser.error("--requests and --repeats must be >= 1, --targets and --prompt-tokens non-empty")
    try:
        evict = evictor(args.evict) if args.evict else None
    except ValueError as exc:
        parser.error(str(exc))
    if args.heap == "kept" and not keep_heap():
        print(
            "bench_split: no glibc mallopt here; the heap is glibc's default (see the faults)",
            file=sys.stderr,
        )
    bodies = {p: chat_body(p, False, model=FAST_MODEL) for p in prompts}
    figures: dict[tuple[str, int], list[float]] = {}
    faults: dict[tuple[str, int], list[float]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="kvroute-split-") as tmp,
        zero_delay_engines("fast", 2, Path(tmp)) as ups,
    ):
        answers = {p: _capture(ups[0].url, body) for p, body in bodies.items()}
        for repeat in range(args.repeats):
            for target in targets:  # interleaved: every target once per repeat
                policy, tok = target.removesuffix("+tok"), target.endswith("+tok")
                faulted: dict[int, list[float]] = {}
                got = asyncio.run(
                    _run_target(policy, tok, ups, answers, bodies, args.requests, evict, faults=faulted)
                )
                for prompt, us in got.items():
                    figures.setdefault((target, prompt), []).append(us)
                    faults.setdefault((target, prompt), []).extend(faulted[prompt])
                    print(f"  r{repeat} {target:<20} {prompt:>6} tok  {us:7.1f} µs/request", file=sys.stderr)
    print(
        "| target | prompt tokens | router CPU µs/request, no network (median [range]) "
        "| minor page faults/request (median) |"
    )
    print("|---|---|---|---|")
    for (target, prompt), values in figures.items():
        print(
            f"| {target} | {prompt} | {statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}] "
            f"| {statistics.median(faults[target, prompt]):.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
