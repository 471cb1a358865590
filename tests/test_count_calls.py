"""loadtest/count_calls.py (Python frames and bytecodes per request, live and in the split) and
bench_split's ``--evict`` (round dp15)."""

from __future__ import annotations

import asyncio
import dis
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from loadtest import bench_split
from loadtest.bench_peers import FAST_MODEL, chat_body, zero_delay_engines
from loadtest.count_calls import (
    CallCounter,
    by_file,
    count_live,
    count_split,
    exact_load,
    part_of,
    per_request,
)


def _straight(a: int, b: int) -> int:
    c = a + b
    return c * 2


def test_the_counter_counts_each_call_and_each_bytecode_executed() -> None:
    """Five calls of a straight-line function: five frames, and its instructions after RESUME
    (which sys.settrace does not report) five times; three calls of ``len``; nothing once stopped."""
    counter = CallCounter()
    counter.start()
    for i in range(5):
        _straight(i, 1)
    [len("ab") for _ in range(3)]  # C calls from Python: 3 of len
    counter.stop()
    _straight(0, 0)
    len("c")
    (name,) = [k for k in counter.table() if k.endswith(":_straight")]
    assert name.endswith(f"test_count_calls.py:{_straight.__code__.co_firstlineno}:_straight")
    steps = len(list(dis.get_instructions(_straight))) - 1
    assert counter.table()[name] == [5, 5 * steps]
    assert counter.table()["C:builtins.len"] == [3, 0]


def test_functions_are_put_in_their_part() -> None:
    assert part_of("router/fastpath.py:93:__init__").startswith("client protocol")
    assert part_of("uvicorn/protocols/http/httptools_impl.py:241:on_header").startswith("client protocol")
    assert part_of("router/proxy.py:290:on_header").startswith("upstream protocol")
    assert part_of("kvcore/core.py:145:_change").startswith("kvroute's own work")
    assert part_of("stdlib/asyncio/events.py:80:_run").startswith("asyncio")
    assert part_of("stdlib/_weakrefset.py:85:add").startswith("other")


def test_functions_are_summed_per_source_file() -> None:
    table = {
        "router/routing.py:570:serve": (2.0, 98.0),
        "router/routing.py:737:_forward": (2.0, 179.0),
        "kvcore/core.py:151:_change": (2.0, 100.0),
        "C:builtins.len": (32.0, 0.0),  # a C call: no bytecodes, no file
    }
    assert by_file(table) == {"router/routing.py": (4.0, 277.0), "kvcore/core.py": (2.0, 100.0)}


def test_evict_specs_are_checked() -> None:
    assert bench_split.evictor("mem:4")() is not None
    assert bench_split.evictor("code:1")() is not None
    assert bench_split.evictor("none")() is None
    for bad in ("mem:0", "disk:4", "code:x", "mem", "mem:-1", "none:1", "switch:x", "switch:-1", "code:0"):
        with pytest.raises(ValueError):
            bench_split.evictor(bad)
    with pytest.raises(SystemExit):
        bench_split.main(["--evict", "mem:-1"])


@pytest.mark.slow
def test_bench_split_runs_with_a_process_switch_before_every_request() -> None:
    """``--evict switch:0`` (a child process pinned to the same core, in its own process here so
    the test session keeps its affinity): the figures come out and the child is gone at exit."""
    out = subprocess.run(
        [
            *(sys.executable, "-m", "loadtest.bench_split", "--targets", "round_robin"),
            *("--prompt-tokens", "300", "--requests", "40", "--repeats", "1", "--evict", "switch:0"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "| round_robin | 300 |" in out, out


@pytest.mark.slow
def test_live_and_split_counts_are_per_request_exactly() -> None:
    """A live round_robin router counted over 4 connections x 6 requests: the functions a request
    runs once (kvroute's parse, the exchange, the upstream request) are counted 1.00 per request, so
    no request is cut or counted twice and the serving thread is the one traced; the split counts
    its once-per-request functions once too, and has no network protocol in it. The raw proxy's
    request handler: once per request."""
    if shutil.which("wrk") is None:
        pytest.skip("wrk (Debian package) is not installed: apt-get install wrk")
    with (
        tempfile.TemporaryDirectory() as tmp,
        zero_delay_engines("fast", 2, Path(tmp)) as engines,
    ):
        body = chat_body(300, False, model=FAST_MODEL)
        table, n = count_live("kvroute:round_robin", engines, body, 4, 6, Path(tmp))
        assert n == 24
        live = per_request(table, n)

        def once(table: dict[str, tuple[float, float]], suffix: str) -> float:
            (name,) = [k for k in table if k.endswith(suffix)]
            return table[name][0]

        assert once(live, ":parse_request") == 1.0
        exchange = [
            v[0] for k, v in live.items() if k.startswith("router/fastpath.py:") and k.endswith(":__init__")
        ]
        assert exchange == [1.0]  # ProxyExchange (the connections were opened before the count)
        split = per_request(count_split("round_robin", engines, 300, 50), 50)
        assert once(split, ":parse_request") == 1.0
        assert not [k for k in split if k.startswith(("router/proxy.py", "uvicorn/"))]
        assert sum(f for f, _ in live.values()) > sum(f for f, _ in split.values())
        raw, n = count_live("raw_proxy", engines, body, 4, 6, Path(tmp))
        assert n == 24
        handler = [v[0] / n for k, v in raw.items() if k.startswith("loadtest/bench_proxy.py:")]
        assert handler and max(handler) == 1.0


def _chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (*pieces, b""))


@pytest.mark.parametrize(
    ("answer", "ok"),
    [
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}", True),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
            + _chunked(b"data: 1\n\n", b"data: [DONE]\n\n"),
            True,
        ),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + _chunked(b"data: 1\n\n"), False),
        (b"HTTP/1.1 200 OK\r\n\r\n", False),
        (b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n", False),
    ],
)
def test_the_exact_load_reads_whole_answers_and_streams_to_their_done(answer: bytes, ok: bool) -> None:
    """``exact_load`` reads a content-length answer, or a chunked stream to its last chunk, which
    must end with ``data: [DONE]``; anything else fails the count (a cut answer is not counted)."""

    async def run() -> int:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                writer.write(answer)
                await writer.drain()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            return await asyncio.wait_for(exact_load(port, b"{}", 2, 3), 10)
        finally:
            server.close()

    if ok:
        assert asyncio.run(run()) == 6
    else:
        with pytest.raises(RuntimeError):
            asyncio.run(run())


@pytest.mark.slow
@pytest.mark.parametrize("target", ["kvroute:round_robin", "kvroute:round_robin+cb"])
def test_a_streamed_answer_is_counted_once_per_request(target: str) -> None:
    """``--stream yes`` on both paths: 4 connections x 6 streams of 4 events, each read to its
    [DONE]; the functions a stream runs once (the parse, the stream's answer and relay set-up, its
    end's accounting) are counted exactly 1.00 per request, so no stream is cut or counted twice."""
    if shutil.which("wrk") is None:
        pytest.skip("wrk (Debian package) is not installed: apt-get install wrk")
    with (
        tempfile.TemporaryDirectory() as tmp,
        zero_delay_engines("fast", 2, Path(tmp)) as engines,
    ):
        body = chat_body(300, True, max_tokens=4, model=FAST_MODEL)
        table, n = count_live(target, engines, body, 4, 6, Path(tmp))
        assert n == 24
        live = per_request(table, n)
        for suffix in (":parse_request", ":_stream_answer", ":_first_token", ":end", ":_close"):
            (name,) = [k for k in live if k.startswith("router/routing.py:") and k.endswith(suffix)]
            assert live[name][0] == 1.0, (name, live[name])
