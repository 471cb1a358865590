"""Regenerate or check the deterministic result tables of docs/benchmarks.md from their commands.

A regenerated table is a block of the page whose first line is the command, as a reader runs it
from the repository root, and whose rest is what that command printed:

    <!-- results:NAME -->
    `kvroute sim --concurrency 16,64 --engines 4 ...`

    | concurrency | policy | ... |
    <!-- /results -->

``python -m loadtest.results --write`` runs every block's command and puts the markdown tables it
printed under the command; ``--check`` runs them and fails on any difference. Columns of wall time
are left out (they measure the machine, not the code). Only seeded, virtual-time commands belong in
blocks (the DES, ``kvroute sim``, ``loadtest.bench_quality``); live measurements stay on the page as
measured, with their command, date and machine state.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DOC = REPO / "docs" / "benchmarks.md"

_OPEN = re.compile(r"^<!-- results:([a-z0-9][a-z0-9_-]*) -->$")
_CLOSE = "<!-- /results -->"
_COMMAND = re.compile(r"^`([^`]+)`$")


class ResultsError(Exception):
    """A block of the page or its command is unusable; the message says which and why."""


@dataclass(frozen=True, slots=True)
class Block:
    """One regenerated table: its name, its command and the lines [start, end) of the page
    between its markers (the command line included)."""

    name: str
    command: str
    start: int
    end: int


def find_blocks(lines: Sequence[str]) -> list[Block]:
    """Every ``<!-- results:NAME -->`` ... ``<!-- /results -->`` block of the page, in order."""
    blocks: list[Block] = []
    names: set[str] = set()
    i = 0
    while i < len(lines):
        opened = _OPEN.match(lines[i].strip())
        if not opened:
            if lines[i].strip().startswith("<!-- results"):
                raise ResultsError(f"line {i + 1}: malformed marker {lines[i].strip()!r}")
            i += 1
            continue
        name = opened.group(1)
        if name in names:
            raise ResultsError(f"line {i + 1}: a second block named {name!r}")
        names.add(name)
        try:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == _CLOSE)
        except StopIteration:
            raise ResultsError(f"line {i + 1}: block {name!r} has no closing {_CLOSE}") from None
        if any(_OPEN.match(line.strip()) for line in lines[i + 1 : end]):
            raise ResultsError(f"line {i + 1}: block {name!r} opens another block before {_CLOSE}")
        command = _COMMAND.match(lines[i + 1].strip()) if i + 1 < end else None
        if command is None:
            raise ResultsError(
                f"line {i + 2}: block {name!r} must start with its command as one `code span` line"
            )
        blocks.append(Block(name, command.group(1), i + 1, end))
        i = end + 1
    return blocks


def command_argv(command: str) -> list[str]:
    """The printed command as this interpreter runs it: ``kvroute ...`` is ``python -m router.cli``
    (the console script), ``python`` / ``.venv/bin/python`` is this interpreter."""
    words = shlex.split(command)
    if not words:
        raise ResultsError("empty command")
    head, rest = words[0], words[1:]
    if head in {"kvroute", ".venv/bin/kvroute"}:
        return [sys.executable, "-m", "router.cli", *rest]
    if head in {"python", "python3", ".venv/bin/python"} and rest[:1] == ["-m"]:
        return [sys.executable, *rest]
    raise ResultsError(f"{command!r}: a block's command is `kvroute ...` or `python -m MODULE ...`")


def markdown_tables(output: str) -> list[list[str]]:
    """The markdown tables (runs of lines starting with ``|``) in a command's output."""
    tables: list[list[str]] = []
    current: list[str] = []
    for line in output.splitlines():
        if line.startswith("|"):
            current.append(line.rstrip())
        elif current:
            tables.append(current)
            current = []
    if current:
        tables.append(current)
    return tables


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def drop_wall_columns(table: list[str]) -> list[str]:
    """The table without its columns of wall time (header ``wall`` / ``wall s``...): they differ
    from run to run and machine to machine, the rest of a seeded run does not."""
    header = _cells(table[0])
    keep = [i for i, name in enumerate(header) if not name.lower().startswith("wall")]
    if len(keep) == len(header):
        return table
    return ["| " + " | ".join(_cells(line)[i] for i in keep) + " |" for line in table]


def run_block(block: Block, timeout_s: float) -> list[str]:
    """Run the block's command; the lines that belong under it (its tables, blank-separated)."""
    argv = command_argv(block.command)
    try:
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ResultsError(f"{block.name}: `{block.command}` ran over {timeout_s:.0f} s") from None
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).splitlines()[-15:])
        raise ResultsError(f"{block.name}: `{block.command}` exited {done.returncode}:\n{tail}")
    tables = markdown_tables(done.stdout)
    if not tables:
        raise ResultsError(f"{block.name}: `{block.command}` printed no markdown table")
    out: list[str] = []
    for table in tables:
        out += ["", *drop_wall_columns(table)]
    return [*out, ""]  # a blank line ends the table before the closing marker in every renderer


def render(lines: list[str], block: Block, body: list[str]) -> list[str]:
    """The page with ``body`` in place of what stood under the block's command."""
    return [*lines[: block.start + 1], *body, *lines[block.end :]]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.results", description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="re-run every block; exit 1 on a difference")
    mode.add_argument("--write", action="store_true", help="re-run every block and rewrite its tables")
    mode.add_argument("--list", action="store_true", help="print each block's name and command")
    parser.add_argument("--doc", type=Path, default=DEFAULT_DOC, help="the page (default docs/benchmarks.md)")
    parser.add_argument("--only", default="", help="comma-separated block names (default: all)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per command")
    args = parser.parse_args(argv)
    try:
        text = args.doc.read_text()
    except OSError as exc:
        print(f"results: cannot read {args.doc}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    lines = text.splitlines()
    try:
        blocks = find_blocks(lines)
        wanted = {name for name in args.only.split(",") if name}
        unknown = wanted - {b.name for b in blocks}
        if unknown:
            raise ResultsError(
                f"--only: no block named {', '.join(sorted(unknown))} in {args.doc} "
                f"(blocks: {', '.join(b.name for b in blocks) or 'none'})"
            )
        if args.list:
            for block in blocks:
                print(f"{block.name}: {block.command}")
            return 0
        differ: list[str] = []
        wall0 = time.perf_counter()
        for name in [b.name for b in blocks if not wanted or b.name in wanted]:
            # Found again each time: a rewritten block before this one moved its lines.
            block = next(b for b in find_blocks(lines) if b.name == name)
            t0 = time.perf_counter()
            body = run_block(block, args.timeout_s)
            old = lines[block.start + 1 : block.end]
            same = [line.rstrip() for line in old] == body
            print(f"{name}: {'same' if same else 'DIFFERS'} ({time.perf_counter() - t0:.0f} s)", flush=True)
            if same:
                continue
            differ.append(name)
            if args.check:
                sys.stdout.writelines(
                    difflib.unified_diff(
                        [line + "\n" for line in old],
                        [line + "\n" for line in body],
                        f"{args.doc} ({name})",
                        f"`{block.command}`",
                    )
                )
            else:  # written block by block: a sweep stopped halfway keeps the tables it finished
                lines = render(lines, block, body)
                args.doc.write_text("\n".join(lines) + ("\n" if text.endswith("\n") else ""))
                print(f"rewrote {name} in {args.doc}", flush=True)
    except ResultsError as exc:
        print(f"results: {exc}", file=sys.stderr)
        return 2
    print(f"{len(wanted or blocks)} blocks in {time.perf_counter() - wall0:.0f} s", flush=True)
    if args.check and differ:
        print(
            f"results: {len(differ)} table(s) differ from their commands: {', '.join(differ)} "
            "(python -m loadtest.results --write rewrites them)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
