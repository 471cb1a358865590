"""Where a router process's samples go, from a py-spy profile (issue 26's "py-spy profile after").

Reads py-spy's raw (collapsed-stack) output of a run made with ``--subprocesses``, keeps the
samples of the processes whose command line contains ``--process`` (e.g. ``--policy tier_cost``),
drops the start-up (any stack through the import system) and puts each remaining sample in one
part by its innermost Python frame:

- ``socket writes``: a line that calls ``.write(`` or ``.writelines(`` (a transport write: the send
  system call, and whatever the kernel does in it, is charged to the Python line that made it);
- ``event loop``: asyncio's ``Runner.run`` itself (uvloop's C loop: epoll, reads, callbacks);
- ``client protocol``: router/fastpath.py, router/guard.py, uvicorn, h11/httptools glue;
- ``upstream protocol``: router/proxy.py;
- ``kvroute's own work``: every other file of the project (routing, app, kvcore, policies, ...);
- ``other``: the rest (the standard library, third-party code).

py-spy samples wall time while a thread is not asleep, so a sample may be a thread waiting for a
CPU (on a busy 2-core machine, a write that wakes its receiver can be preempted): read the parts as
shares of the router's busy time, not as CPU. Usage::

    py-spy record -r 1000 --subprocesses --nonblocking -f raw -o prof.txt -- \\
        python -m loadtest.bench_peers --targets kvroute:tier_cost+tok --concurrency 64 \\
        --stream no --prompt-tokens 1000 --duration 5 --warmup 1 --repeats 1
    python tools/pyspy_split.py prof.txt --process "--policy tier_cost"
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*):(?P<line>\d+)\)$")
_CLIENT = ("router/fastpath.py", "router/guard.py", "uvicorn/", "httptools/")
_PROJECT = ("router/", "kvcore/", "policies/", "sim/", "loadtest/")
PARTS = (
    "socket writes",
    "event loop",
    "client protocol",
    "upstream protocol",
    "kvroute's own work",
    "other",
)


def _source_line(root: Path, file: str, line: int, cache: dict[str, list[str]]) -> str:
    if file not in cache:
        path = root / file
        try:
            cache[file] = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
        except OSError:
            cache[file] = []
    lines = cache[file]
    return lines[line - 1] if 0 < line <= len(lines) else ""


def part_of(frame: str, root: Path, cache: dict[str, list[str]]) -> str:
    """The part an innermost frame ``function (file:line)`` belongs to (see the module's doc)."""
    match = _FRAME.match(frame)
    if match is None:
        return "other"
    file, function = match["file"], match["function"]
    source = _source_line(root, file, int(match["line"]), cache)
    if ".write(" in source or ".writelines(" in source:
        return "socket writes"
    if function == "Runner.run" and file.endswith("asyncio/runners.py"):
        return "event loop"
    if any(part in file for part in _CLIENT):
        return "client protocol"
    if file.startswith("router/proxy.py"):
        return "upstream protocol"
    if file.startswith(_PROJECT):
        return "kvroute's own work"
    return "other"


def split(
    text: str, process: str, root: Path
) -> tuple[int, collections.Counter[str], collections.Counter[str]]:
    """(samples kept, samples per part, samples per innermost function) of ``process``."""
    parts: collections.Counter[str] = collections.Counter()
    functions: collections.Counter[str] = collections.Counter()
    cache: dict[str, list[str]] = {}
    kept = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        # --subprocesses roots each stack at its process's ancestors: the innermost one is its own.
        owner = next((f for f in reversed(frames) if f.startswith("process ")), "")
        if process not in owner or any("importlib._bootstrap" in f for f in frames):
            continue
        leaf = frames[-1]
        kept += int(count)
        parts[part_of(leaf, root, cache)] += int(count)
        functions[re.sub(r":\d+\)$", ")", leaf)] += int(count)
    return kept, parts, functions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path, help="py-spy record -f raw output (--subprocesses)")
    parser.add_argument("--process", required=True, help="a string of the router process's command line")
    parser.add_argument("--root", type=Path, default=Path("."), help="the checkout the profile ran from")
    parser.add_argument("--top", type=int, default=12, help="innermost functions to list")
    args = parser.parse_args(argv)
    kept, parts, functions = split(args.profile.read_text(encoding="utf-8"), args.process, args.root)
    if not kept:
        print(f"no samples of a process matching {args.process!r} (after start-up)", file=sys.stderr)
        return 1
    print(f"{kept} samples of {args.process!r} after start-up\n")
    print("| part | share of samples |\n|---|---|")
    for part in PARTS:
        print(f"| {part} | {100 * parts[part] / kept:.1f}% |")
    print("\n| innermost function | share |\n|---|---|")
    for function, count in functions.most_common(args.top):
        print(f"| {function.replace('|', '/')} | {100 * count / kept:.1f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
