"""Python frames and bytecodes per request, counted inside a live router under wrk and in the split.

Round dp15 (issue 26): B3's router CPU per request is ~2x what ``kvroute bench split``
(loadtest/bench_split.py) measures as kvroute's own work plus what the raw proxy pays for the
network. This tool counts instead of timing - deterministic, whatever the machine's load - with a
``sys.settrace`` tracer on the serving thread: every Python frame entered (a call, or a generator
or coroutine resumed) and every bytecode executed, per function, and (``sys.setprofile``) every
call of a C function from Python code. The C work itself (msgspec, httptools, uvloop, asyncio's
task steps, the kernel) is not measured.

Live: each target is started as B3 starts it (``loadtest.bench_peers.start_target``: ``kvroute
serve`` or the raw proxy, behind two zero-delay ``fast`` upstreams), with a ``sitecustomize`` on
its ``PYTHONPATH`` that calls :func:`install_from_env`: the process's main thread - the one that
serves - is traced between two SIGUSR1 (nothing is traced, nor imported, without it). wrk warms it
up; ``--concurrency`` keep-alive connections are opened and answered once; the first SIGUSR1 starts
the count; each connection sends ``--per-connection`` requests, closed loop, every answer read in
full (so no request is cut at the count's ends, as wrk cuts its last ones); the second SIGUSR1
writes the counts. The router's background work in that time (health polls, scrapes) is counted
too.

Split: bench_split's harness for the same policy and prompt, counted from its first request to its
last answer (the harness's own functions left out); non-stream answers only.

``--stream yes`` (or ``yesN``) counts streamed answers instead, as B3's ``--stream`` asks for them
(4 or N events an answer from the ``fast`` upstream): each answer is read chunk by chunk to its
last and must end with ``data: [DONE]``; live only (round dp20).

    python -m loadtest.count_calls --targets kvroute:round_robin,kvroute:tier_cost+tok,raw_proxy \
        --concurrency 64 --per-connection 20
    python -m loadtest.count_calls --targets kvroute:round_robin,raw_proxy --stream yes
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

#: The folder a traced process writes its counts to; set only for the target's own process.
ENV = "COUNT_CALLS_DIR"

_REPO = Path(__file__).resolve().parents[1]
_STDLIB = re.compile(r"/lib/python3\.\d+/")


def code_name(code: CodeType) -> str:
    """``path:line:function``, the path from the package folder on (the same in every checkout)."""
    path = code.co_filename
    if "/site-packages/" in path:
        path = path.split("/site-packages/", 1)[1]
    elif _STDLIB.search(path):
        path = "stdlib/" + _STDLIB.split(path, 1)[1]
    else:
        for top in ("/router/", "/kvcore/", "/policies/", "/loadtest/", "/sim/"):
            if top in path:
                path = top[1:] + path.rsplit(top, 1)[1]
                break
    return f"{path}:{code.co_firstlineno}:{code.co_name}"


def c_name(function: Any) -> str:
    """``module.qualname`` of a C function or method (``asyncio.Future.add_done_callback``)."""
    owner = getattr(function, "__self__", None)
    module = getattr(function, "__module__", None) or type(owner).__module__
    return f"{module}.{getattr(function, '__qualname__', repr(function))}"


class CallCounter:
    """Counts, on the thread that calls :meth:`start`, every Python frame entered and every
    bytecode executed, per code object, and every call of a C function from Python code
    (``sys.setprofile``'s ``c_call``: C called from C, such as httptools calling a callback or the
    loop running a task step, is not seen), until :meth:`stop`."""

    def __init__(self) -> None:
        self.frames: dict[CodeType, int] = {}
        self.ops: dict[CodeType, int] = {}
        self.c_calls: dict[str, int] = {}

    def start(self) -> None:
        sys.setprofile(self._profile)
        sys.settrace(self._call)

    def stop(self) -> None:
        sys.settrace(None)
        sys.setprofile(None)

    def reset(self) -> None:
        self.frames.clear()
        self.ops.clear()
        self.c_calls.clear()

    def _call(self, frame: FrameType, event: str, arg: object) -> Any:
        code = frame.f_code
        self.frames[code] = self.frames.get(code, 0) + 1
        frame.f_trace_opcodes = True
        return self._local

    def _local(self, frame: FrameType, event: str, arg: object) -> Any:
        if event == "opcode":
            code = frame.f_code
            self.ops[code] = self.ops.get(code, 0) + 1
        return self._local

    def _profile(self, frame: FrameType, event: str, arg: object) -> None:
        if event == "c_call":
            name = c_name(arg)
            self.c_calls[name] = self.c_calls.get(name, 0) + 1

    def table(self) -> dict[str, list[int]]:
        """``code_name`` -> [frames, bytecodes] (code objects of one name summed); a C function's
        calls as ``C:module.qualname`` -> [calls, 0]."""
        out: dict[str, list[int]] = {}
        for code in self.frames.keys() | self.ops.keys():
            row = out.setdefault(code_name(code), [0, 0])
            row[0] += self.frames.get(code, 0)
            row[1] += self.ops.get(code, 0)
        for name, calls in self.c_calls.items():
            out["C:" + name] = [calls, 0]
        return out


def install_from_env() -> None:
    """In a process started with ``COUNT_CALLS_DIR``: SIGUSR1 starts counting on the main thread,
    the next writes the counts to ``DIR/counts-PID-N.json`` (written whole, then renamed; on the
    event loop's next turn when one runs, so no callback is cut), and so on. Also writes
    ``DIR/started-PID-N`` when a count starts."""
    folder = os.environ.get(ENV)
    if not folder:
        return
    counter = CallCounter()
    state = {"on": False, "n": 0}

    def toggle(signum: int, _frame: object) -> None:
        pid = os.getpid()
        if not state["on"]:
            counter.reset()
            state["on"] = True
            counter.start()
            Path(folder, f"started-{pid}-{state['n']}").touch()
            return
        state["on"] = False
        # A Python signal handler runs between two bytecodes, so it may stop the count in the
        # middle of an event-loop callback: the last answer's bytes are out (the client saw its
        # end and sent the signal) while the callback that wrote them has not yet run its
        # accounting. Stopping on the loop's next turn counts that callback whole.
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop on this thread: nothing can be cut
            finish(pid)
        else:
            loop.call_soon_threadsafe(finish, pid)

    def finish(pid: int) -> None:
        counter.stop()
        tmp = Path(folder, f".counts-{pid}-{state['n']}.json")
        tmp.write_text(json.dumps(counter.table()))
        tmp.rename(Path(folder, f"counts-{pid}-{state['n']}.json"))
        state["n"] += 1

    signal.signal(signal.SIGUSR1, toggle)


def _wait_file(path: Path, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > end:
            raise RuntimeError(f"{path} not written after {timeout_s:.0f} s (is the process traced?)")
        time.sleep(0.02)


@contextlib.contextmanager
def traced_env(site_dir: Path, out_dir: Path) -> Iterator[None]:
    """``os.environ`` with the counting ``sitecustomize`` and ``COUNT_CALLS_DIR`` while a target
    starts (start_target copies the environment when it starts the process), restored after."""
    site_dir.mkdir(parents=True, exist_ok=True)
    (site_dir / "sitecustomize.py").write_text(
        "import sys\n"
        f"sys.path.append({str(_REPO)!r})  # this tool, after the target checkout's own packages\n"
        "from loadtest.count_calls import install_from_env\n"
        "install_from_env()\n"
    )
    saved = {k: os.environ.get(k) for k in (ENV, "PYTHONPATH")}
    os.environ[ENV] = str(out_dir)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site_dir), saved["PYTHONPATH"]) if p)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def _one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> None:
    """One request and its whole answer: a content-length body, or a chunked (streamed) one read
    chunk by chunk to its last, which must end with the stream's ``data: [DONE]``."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"answer {head[:200]!r}")
    lines = head.lower().split(b"\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in lines if line.startswith(b"content-length:")), -1)
    if length >= 0:
        await reader.readexactly(length)
        return
    if b"transfer-encoding: chunked" not in lines:
        raise RuntimeError(f"an answer with neither a length nor chunks: {head[:200]!r}")
    last = b""
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        chunk = await reader.readexactly(size + 2)
        if not size:
            break
        last = chunk[:-2]
    if not last.endswith(b"data: [DONE]\n\n"):
        raise RuntimeError(f"a stream without its final [DONE]: ...{last[-200:]!r}")


async def exact_load(
    port: int, body: bytes, connections: int, per_connection: int, between: Any = None
) -> int:
    """``connections`` keep-alive connections, each answered once, then ``between()`` (the count's
    start), then ``per_connection`` requests on each, closed loop; returns the requests sent after
    ``between``. Every one is answered 200 in full (or it raises), so none is cut in the count."""
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(connections)]
    try:
        await asyncio.gather(*(_one(r, w, request) for r, w in conns))
        if between is not None:
            await asyncio.to_thread(between)

        async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for _ in range(per_connection):
                await _one(reader, writer, request)

        await asyncio.gather(*(run(r, w) for r, w in conns))
    finally:
        for _, writer in conns:
            writer.close()
    return connections * per_connection


def count_live(
    spec: str,
    engines: Sequence[Any],
    body: bytes,
    concurrency: int,
    per_connection: int,
    workdir: Path,
    checkouts: dict[str, str] | None = None,
) -> tuple[dict[str, list[int]], int]:
    """(counts, requests) of target ``spec`` (a bench_peers target; ``checkouts`` as its
    ``--checkout``): warmed up by wrk, then counted over ``per_connection`` requests on each of
    ``concurrency`` connections opened before."""
    from loadtest.bench_peers import Target, default_peers_dir, run_wrk, start_target

    out = workdir / f"counts-{spec.replace(':', '_').replace('+', '_')}"
    out.mkdir(parents=True, exist_ok=True)
    ctx = start_target(Target.parse(spec, checkouts), engines, workdir, default_peers_dir())
    with traced_env(workdir / "site", out):
        url, pid = ctx.__enter__()
    try:
        assert pid is not None, spec
        run_wrk(url, body, concurrency, 1.0, workdir)  # warm-up: pools, caches

        def start() -> None:
            os.kill(pid, signal.SIGUSR1)
            _wait_file(out / f"started-{pid}-0")

        port = int(url.rsplit(":", 1)[1])
        n = asyncio.run(exact_load(port, body, concurrency, per_connection, start))
        os.kill(pid, signal.SIGUSR1)
        _wait_file(out / f"counts-{pid}-0.json")
        table = json.loads((out / f"counts-{pid}-0.json").read_text())
    finally:
        ctx.__exit__(None, None, None)
    return table, n


def count_split(
    target: str, engines: Sequence[Any], prompt_tokens: int, requests: int
) -> dict[str, list[int]]:
    """Counts of bench_split's harness for ``target`` (POLICY[+tok]) over ``requests`` requests."""
    from loadtest.bench_peers import FAST_MODEL, chat_body
    from loadtest.bench_split import _capture, _run_target

    body = chat_body(prompt_tokens, False, model=FAST_MODEL)
    answers = {prompt_tokens: _capture(engines[0].url, body)}
    counter = CallCounter()
    asyncio.run(
        _run_target(
            target.removesuffix("+tok"),
            target.endswith("+tok"),
            engines,
            answers,
            {prompt_tokens: body},
            requests,
            counter=counter,
        )
    )
    return {k: v for k, v in counter.table().items() if not k.startswith("loadtest/bench_split.py:")}


#: (prefix of ``code_name``, part) in order; the first match names a function's part.
PARTS = (
    ("router/fastpath.py", "client protocol (fastpath, guard, uvicorn)"),
    ("router/guard.py", "client protocol (fastpath, guard, uvicorn)"),
    ("uvicorn/", "client protocol (fastpath, guard, uvicorn)"),
    ("router/proxy.py", "upstream protocol (router/proxy.py)"),
    ("router/", "kvroute's own work (router, kvcore, policies)"),
    ("kvcore/", "kvroute's own work (router, kvcore, policies)"),
    ("policies/", "kvroute's own work (router, kvcore, policies)"),
    ("loadtest/bench_proxy.py", "raw proxy (loadtest/bench_proxy.py)"),
    ("stdlib/asyncio/", "asyncio (its Python parts)"),
)


def part_of(name: str) -> str:
    return next((part for prefix, part in PARTS if name.startswith(prefix)), "other (stdlib, libraries)")


def parts(table: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    out: dict[str, tuple[float, float]] = {}
    for name, (f, o) in table.items():
        part = "C functions called from Python (calls)" if name.startswith("C:") else part_of(name)
        pf, po = out.get(part, (0.0, 0.0))
        out[part] = (pf + f, po + o)
    return out


def totals(table: dict[str, list[int]], requests: int) -> tuple[float, float, float]:
    """(Python frames, bytecodes, C calls from Python) per request."""
    py = [r for k, r in table.items() if not k.startswith("C:")]
    c_calls = sum(r[0] for k, r in table.items() if k.startswith("C:"))
    return (sum(r[0] for r in py) / requests, sum(r[1] for r in py) / requests, c_calls / requests)


def per_request(table: dict[str, list[int]], requests: int) -> dict[str, tuple[float, float]]:
    return {k: (v[0] / requests, v[1] / requests) for k, v in table.items()}


def compare(
    live: dict[str, tuple[float, float]], split: dict[str, tuple[float, float]], top: int
) -> list[str]:
    """Markdown rows: the functions whose bytecodes per request differ most, live against split."""
    rows = []
    for name in live.keys() | split.keys():
        lf, lo = live.get(name, (0.0, 0.0))
        sf, so = split.get(name, (0.0, 0.0))
        rows.append((lo - so, name, lf, lo, sf, so))
    rows.sort(key=lambda r: -abs(r[0]))
    c_rows = sorted((r for r in rows if r[1].startswith("C:")), key=lambda r: -abs(r[2] - r[4]))
    rows = [r for r in rows if not r[1].startswith("C:")][:top] + c_rows[: top // 2]
    out = [
        "| function | live frames/req | live bytecodes/req | split frames/req | split bytecodes/req "
        "| live - split bytecodes |",
        "|---|---|---|---|---|---|",
    ]
    for diff, name, lf, lo, sf, so in rows:
        out.append(f"| `{name}` | {lf:.2f} | {lo:.1f} | {sf:.2f} | {so:.1f} | {diff:+.1f} |")
    return out


def by_file(table: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """Frames and bytecodes per request summed per source file (a ``code_name``'s path; C calls,
    which have no bytecodes, left out)."""
    out: dict[str, tuple[float, float]] = {}
    for name, (f, o) in table.items():
        if name.startswith("C:"):
            continue
        path = name.split(":", 1)[0]
        frames, ops = out.get(path, (0.0, 0.0))
        out[path] = (frames + f, ops + o)
    return out


def top_rows(table: dict[str, tuple[float, float]], top: int) -> list[str]:
    out = ["| function or part | frames/req | bytecodes/req |", "|---|---|---|"]
    for name, (f, o) in sorted(table.items(), key=lambda kv: -kv[1][1])[:top]:
        out.append(f"| `{name}` | {f:.2f} | {o:.1f} |")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--targets",
        default="kvroute:round_robin,kvroute:tier_cost+tok,raw_proxy",
        help="bench_peers targets counted live; each kvroute one (but +cb) is also counted in the split",
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--per-connection", type=int, default=20, help="requests counted per connection")
    parser.add_argument("--split-requests", type=int, default=2000)
    parser.add_argument("--top", type=int, default=40, help="functions listed per target")
    parser.add_argument("--files", type=int, default=0, help="also the N source files with most bytecodes")
    parser.add_argument("--json", type=Path, default=None, help="also write every count here")
    parser.add_argument(
        "--stream",
        default="no",
        metavar="no|yes|yesN",
        help="non-stream answers (no), or streams of 4 (yes) or N (yesN) events, as B3's --stream; "
        "streams are counted live only (the split has no stream)",
    )
    parser.add_argument(
        "--checkout",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="targets LABEL:POLICY[+tok][+cb] run kvroute from checkout DIR, as bench_peers' "
        "(counted live only; this checkout's tracer)",
    )
    args = parser.parse_args(argv)
    from loadtest.bench_peers import FAST_MODEL, chat_body, stream_mode, zero_delay_engines

    checkouts = dict(item.split("=", 1) for item in args.checkout)

    try:
        events = stream_mode(args.stream)
    except ValueError as exc:
        parser.error(str(exc))
    body = chat_body(args.prompt_tokens, events > 0, max_tokens=events or 4, model=FAST_MODEL)
    dump: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="kvroute-count-") as tmp,
        zero_delay_engines("fast", 2, Path(tmp)) as engines,
    ):
        summary = [
            "| target | where | requests | Python frames/req | bytecodes/req | C calls from Python/req |",
            "|---|---|---|---|---|---|",
        ]
        details: list[str] = []
        for spec in [t for t in args.targets.split(",") if t]:
            table, n = count_live(
                spec, engines, body, args.concurrency, args.per_connection, Path(tmp), checkouts
            )
            live = per_request(table, n)
            frames, ops, c_calls = totals(table, n)
            summary.append(
                f"| {spec} | live c{args.concurrency} | {n} | {frames:.1f} | {ops:.0f} | {c_calls:.1f} |"
            )
            dump[f"{spec} live"] = {"requests": n, "counts": table}
            details += ["", f"{spec}, live, c{args.concurrency}, {n} requests: by part", ""]
            details += top_rows(parts(live), len(PARTS) + 1)
            details += ["", f"{spec}, live, c{args.concurrency}, {n} requests: top functions", ""]
            details += top_rows(live, args.top)
            if args.files:
                details += ["", f"{spec}, live, c{args.concurrency}, {n} requests: by source file", ""]
                details += top_rows(by_file(live), args.files)
            # The split: non-stream answers, the task path (bench_split has no stream, no callbacks).
            if spec.startswith("kvroute:") and not events and not spec.endswith("+cb"):
                target = spec.split(":", 1)[1]
                stable = count_split(target, engines, args.prompt_tokens, args.split_requests)
                split = per_request(stable, args.split_requests)
                frames, ops, c_calls = totals(stable, args.split_requests)
                summary.append(
                    f"| {spec} | split | {args.split_requests} | {frames:.1f} | {ops:.0f} | {c_calls:.1f} |"
                )
                dump[f"{spec} split"] = {"requests": args.split_requests, "counts": stable}
                details += ["", f"{spec}, split: by part", ""]
                details += top_rows(parts(split), len(PARTS) + 1)
                details += ["", f"{spec}: live against split, the largest differences", ""]
                details += compare(live, split, args.top)
    what = f"streamed chat ({events} events an answer)" if events else "non-stream chat"
    print(f"{args.prompt_tokens}-token {what}; Python frames entered and bytecodes per request\n")
    print("\n".join(summary))
    print("\n".join(details))
    if args.json is not None:
        args.json.write_text(json.dumps(dump))
    return 0


if __name__ == "__main__":
    sys.exit(main())
