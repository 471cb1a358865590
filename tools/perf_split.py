"""Where a router process's CPU goes, by shared object, from ``perf`` (issue 26's profile, in CPU).

py-spy (tools/pyspy_split.py) samples wall time while a thread is not asleep: a router preempted in
a send that woke its receiver is counted "in" the write. ``perf record -p PID`` samples the CPU the
process actually uses (user and kernel), so its split by shared object says what a cut can win:

- ``Python interpreter``: libpython / the python binary (bytecode, objects, dicts, allocation);
- ``kernel``: system calls and everything the kernel does in them (TCP on loopback, epoll);
- ``libc``: memcpy/memmove, malloc and the syscall wrappers;
- ``event loop (uvloop)``, ``HTTP parsing (httptools / llhttp)``, ``msgspec``, ``xxhash``: their C
  extensions (a ``_core`` extension is taken for msgspec's);
- ``other``: every other shared object (other extensions, vdso, libm).

``run`` measures live targets one after the other, each as B3 starts it (loadtest/bench_peers.py:
two zero-delay upstreams, wrk -t1 at ``--concurrency`` connections): it starts one bench_peers run
per (target, prompt), waits ``--warmup-s``, records the router process (all its threads) for
``--seconds`` with ``perf record -F 999``, and prints the split with that run's req/s and router
CPU per request (both with perf attached: perf's own sampling inflates the CPU a little). The
shares times the CPU per request give microseconds per request for each part. ``--checkout NAME=DIR``
measures another checkout's router (bench_peers' option; target ``NAME:POLICY``), ``--python
NAME=PATH`` this checkout's router run by another interpreter (the same), and ``--symbols
REGEX`` adds the share of the symbols matching it (e.g. ``richcompare`` for comparisons); ``--keep
DIR`` keeps each recording for other reports (``perf report -i FILE --sort sym``). ``report``
splits a ``perf report --sort dso -g none --stdio`` text already made. Needs ``perf`` (Debian: linux-perf)
and the right to record another process (root, or kernel.perf_event_paranoid <= 1)::

    python tools/perf_split.py run --targets raw_proxy,kvroute:round_robin,kvroute:tier_cost+tok \\
        --prompt-tokens 1000,16000 --peers-dir /tmp/dp_peers
    python tools/perf_split.py report perf-report.txt
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest.bench_peers import Target, interpreters

REPO = Path(__file__).resolve().parents[1]
PARTS = (
    "Python interpreter",
    "kernel",
    "libc",
    "event loop (uvloop)",
    "HTTP parsing (httptools / llhttp)",
    "msgspec",
    "xxhash",
    "other",
)
_ROW = re.compile(r"^\s*(?P<share>\d+(?:\.\d+)?)%\s+(?P<dso>\S.*?)\s*$")


def part_of(dso: str) -> str:
    """The part a shared object's samples belong to (see the module's doc)."""
    name = dso.rsplit("/", 1)[-1]
    if name.startswith("libpython") or re.fullmatch(r"python[\d.]*", name):
        return "Python interpreter"
    if name.startswith("[kernel"):
        return "kernel"
    if name.startswith("libc.so") or name.startswith("libc-"):
        return "libc"
    if name.startswith("loop.cpython"):
        return "event loop (uvloop)"
    if name.startswith(("parser.cpython", "url_parser.cpython", "_http_parser")):
        return "HTTP parsing (httptools / llhttp)"
    if name.startswith("_core.cpython"):
        return "msgspec"
    if name.startswith("_xxhash"):
        return "xxhash"
    return "other"


def split(report: str) -> dict[str, float]:
    """Percent of the samples per part, from ``perf report --sort dso -g none --stdio`` text."""
    parts: dict[str, float] = collections.defaultdict(float)
    for line in report.splitlines():
        if line.startswith("#"):
            continue
        match = _ROW.match(line)
        if match is not None:
            parts[part_of(match["dso"])] += float(match["share"])
    return {part: parts.get(part, 0.0) for part in PARTS}


def symbol_share(report: str, pattern: str) -> float:
    """Percent of the samples in symbols matching ``pattern`` (a regular expression), from
    ``perf report --sort sym -g none --stdio`` text (rows ``  1.23%  [.] name``)."""
    wanted = re.compile(pattern)
    total = 0.0
    for line in report.splitlines():
        match = re.match(r"^\s*(\d+(?:\.\d+)?)%\s+\[.\]\s+(.*\S)\s*$", line)
        if match is not None and wanted.search(match[2]):
            total += float(match[1])
    return total


def table(rows: list[tuple[str, int, float, float, dict[str, float]]]) -> str:
    """Markdown: one row per (target, prompt), each part's share and µs per request (and a
    ``symbols ~ REGEX`` column when the rows have one)."""
    columns = list(PARTS) + [k for k in (rows[0][4] if rows else {}) if k not in PARTS]
    names = [c.replace("|", "\\|") for c in columns]  # (a regex's | would end the cell)
    head = "| target | prompt | req/s (perf on) | router CPU µs/req | " + " | ".join(names) + " |"
    out = [head, "|" + "---|" * (4 + len(columns))]
    for target, prompt, rps, cpu_us, parts in rows:
        cells = [f"{parts[p]:.1f}% ({parts[p] * cpu_us / 100:.0f} µs)" for p in columns]
        out.append(f"| {target} | {prompt} | {rps:.0f} | {cpu_us:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _router_pid(
    spec: str, after: set[int], deadline: float, checkouts: dict[str, str], pythons: dict[str, str]
) -> int:
    """The pid of the process B3 started for ``spec`` (a process started after ``after`` was taken;
    ``checkouts``: bench_peers' ``--checkout`` NAME -> DIR, ``pythons`` its ``--python`` NAME -> PATH)."""
    target = Target.parse(spec, checkouts, pythons)  # bench_peers' own reading of the spec
    wanted = {
        "kvroute": ["router.cli", "serve", f"--policy {target.policy}"],
        "raw_proxy": ["loadtest.bench_proxy", "_raw_proxy"],
    }.get(target.kind, [target.kind])
    while time.monotonic() < deadline:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) in after:
                continue
            try:
                raw = Path(entry.path, "cmdline").read_bytes()
                cmdline = raw.replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if all(w in cmdline for w in wanted) and "bench_peers" not in cmdline and "perf " not in cmdline:
                return int(entry.name)
        time.sleep(0.1)
    raise RuntimeError(f"{spec}: its process did not start")


def _start_ticks(pid: int) -> int:
    """When ``pid`` started (clock ticks since boot; /proc/PID/stat's 22nd field)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[19])


def _wrk_after(ticks: int) -> bool:
    """A wrk process started at or after ``ticks`` runs (the router's load, not direct's)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            comm = Path(entry.path, "comm").read_text().strip()
            if comm == "wrk" and _start_ticks(int(entry.name)) >= ticks:
                return True
        except (OSError, ValueError, IndexError):
            continue
    return False


def _bench_row(b3: dict[str, Any], spec: str, prompt: int) -> tuple[float, float]:
    """(req/s, router CPU µs/req) of ``spec``'s row at ``prompt`` tokens in bench_peers' ``b3.json``."""
    for row in b3["rows"]:
        if row["target"] == spec and row["prompt"] == prompt:
            return float(row["rps"]), float(row["cpu_us_per_req"])
    raise RuntimeError(f"{spec}: no row for {prompt} tokens in bench_peers' b3.json")


def run(args: argparse.Namespace) -> int:
    perf = shutil.which("perf")
    if perf is None:
        print("perf_split: perf is not installed (Debian: linux-perf)", file=sys.stderr)
        return 2
    checkouts = dict(c.split("=", 1) for c in args.checkout)
    try:
        pythons = interpreters(args.python)  # bench_peers' own reading and check of --python
    except ValueError as exc:
        print(f"perf_split: {exc}", file=sys.stderr)
        return 2
    rows = []
    for prompt in [int(p) for p in args.prompt_tokens.split(",") if p]:
        for spec in [t for t in args.targets.split(",") if t]:
            before = {int(e.name) for e in os.scandir("/proc") if e.name.isdigit()}
            cmd = [
                sys.executable, "-m", "loadtest.bench_peers", "--targets", spec, "--concurrency",
                str(args.concurrency), "--stream", "no", "--prompt-tokens", str(prompt), "--duration",
                str(args.warmup_s + args.seconds + 2), "--warmup", "0", "--repeats", "1",
            ]  # fmt: skip
            if args.peers_dir:
                cmd += ["--peers-dir", str(args.peers_dir)]
            for checkout in args.checkout:
                cmd += ["--checkout", checkout]
            for python in args.python:
                cmd += ["--python", python]
            with tempfile.TemporaryDirectory(prefix="kvroute-perf-") as tmp:
                cmd += ["--out", tmp]
                bench = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                try:
                    pid = _router_pid(spec, before, time.monotonic() + 120, checkouts, pythons)
                    # bench_peers loads the router once it answers: wait for that wrk (not direct's).
                    deadline = time.monotonic() + 120
                    while not _wrk_after(_start_ticks(pid)):
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"{spec}: wrk did not start")
                        time.sleep(0.05)
                    time.sleep(args.warmup_s)
                    data = Path(tmp, "perf.data")
                    record = [perf, "record", "-F", "999", "-p", str(pid), "-o", str(data)]
                    subprocess.run(
                        [*record, "--", "sleep", str(args.seconds)],
                        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    )  # fmt: skip
                    report = subprocess.run(
                        [perf, "report", "-i", str(data), "--sort", "dso", "-g", "none", "--stdio"],
                        check=True, capture_output=True, text=True,
                    ).stdout  # fmt: skip
                    symbols = 0.0
                    if args.symbols:
                        by_symbol = subprocess.run(
                            [perf, "report", "-i", str(data), "--sort", "sym", "-g", "none", "--stdio"],
                            check=True, capture_output=True, text=True,
                        ).stdout  # fmt: skip
                        symbols = symbol_share(by_symbol, args.symbols)
                    if args.keep:
                        args.keep.mkdir(parents=True, exist_ok=True)
                        name = re.sub(r"[^A-Za-z0-9_.+-]", "_", f"{spec}-{prompt}") + ".perf.data"
                        shutil.copyfile(data, args.keep / name)
                    output, _ = bench.communicate(timeout=300)
                    if bench.returncode != 0:
                        tail = output.decode(errors="replace")[-2000:]
                        raise RuntimeError(f"{spec}: bench_peers failed:\n{tail}")
                    rps, cpu_us = _bench_row(json.loads(Path(tmp, "b3.json").read_text()), spec, prompt)
                finally:
                    if bench.poll() is None:
                        bench.kill()
                        bench.wait()
            parts = split(report)
            if args.symbols:
                parts[f"symbols ~ {args.symbols}"] = symbols
            rows.append((spec, prompt, rps, cpu_us, parts))
            note = f"  {spec} {prompt} tokens: {rps:.0f} req/s, {cpu_us:.0f} µs/req"
            print(note, file=sys.stderr, flush=True)
    print(table(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="record live B3 targets and print the split")
    r.add_argument("--targets", default="raw_proxy,kvroute:round_robin,kvroute:tier_cost+tok")
    r.add_argument("--prompt-tokens", default="1000")
    r.add_argument("--concurrency", type=int, default=64)
    r.add_argument("--warmup-s", type=float, default=2.0)
    r.add_argument("--seconds", type=float, default=6.0)
    r.add_argument("--peers-dir", type=Path, default=None)
    r.add_argument("--checkout", action="append", default=[], help="NAME=DIR, passed to bench_peers")
    r.add_argument("--python", action="append", default=[], help="NAME=PATH, passed to bench_peers")
    r.add_argument("--symbols", default="", help="also the share of symbols matching this regex")
    r.add_argument(
        "--keep", type=Path, default=None, help="also keep each perf.data here (TARGET-PROMPT.perf.data)"
    )
    p = sub.add_parser("report", help="split a perf report --sort dso -g none --stdio text")
    p.add_argument("report", type=Path)
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args)
    parts = split(args.report.read_text(encoding="utf-8"))
    print("| part | share of CPU samples |\n|---|---|")
    for part in PARTS:
        print(f"| {part} | {parts[part]:.1f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
