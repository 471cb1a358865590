"""tools/perf_split.py: a perf report's shared objects land in the part they belong to, and the
table turns each share into microseconds per request from the run's router CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("perf_split", REPO / "tools" / "perf_split.py")
assert _spec is not None and _spec.loader is not None
perf_split = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(perf_split)

# The shape of `perf report --sort dso -g none --stdio` (perf 6.x), trimmed.
REPORT = """# To display the perf.data header info, please use --header/--header-only options.
#
# Samples: 11K of event 'cpu-clock:ppp'
# Overhead  Shared Object
# ........  ....................................
#
    60.00%  libpython3.11.so.1.0
    15.00%  [kernel.kallsyms]
     5.00%  libc.so.6
     4.00%  loop.cpython-311-x86_64-linux-gnu.so
     3.00%  parser.cpython-311-x86_64-linux-gnu.so
     2.50%  _core.cpython-311-x86_64-linux-gnu.so
     0.50%  _xxhash.cpython-311-x86_64-linux-gnu.so
     8.00%  python3.11
     1.00%  _asyncio.cpython-311-x86_64-linux-gnu.so
     1.00%  [vdso]

#
# (Tip: Show individual samples with: perf script)
"""


def test_each_shared_object_lands_in_its_part() -> None:
    parts = perf_split.split(REPORT)
    assert parts == {
        "Python interpreter": 68.0,  # libpython and the python binary itself
        "kernel": 15.0,
        "libc": 5.0,
        "event loop (uvloop)": 4.0,
        "HTTP parsing (httptools / llhttp)": 3.0,
        "msgspec": 2.5,
        "xxhash": 0.5,
        "other": 2.0,  # _asyncio and the vdso
    }
    assert abs(sum(parts.values()) - 100.0) < 1e-9  # header and tip lines are not rows


def test_the_table_prices_each_share_in_microseconds_per_request() -> None:
    parts = perf_split.split(REPORT)
    text = perf_split.table([("kvroute:round_robin", 1000, 4321.0, 200.0, parts)])
    row = text.splitlines()[2]
    assert row.startswith("| kvroute:round_robin | 1000 | 4321 | 200 | 68.0% (136 µs) | 15.0% (30 µs) |")


def test_a_bench_row_is_found_by_prompt_and_target() -> None:
    """The row of bench_peers' b3.json with the target and the prompt, not another prompt's."""
    b3 = {
        "rows": [
            {"target": "direct", "prompt": 1000, "rps": 9000.0, "cpu_us_per_req": float("nan")},
            {"target": "kvroute:round_robin", "prompt": 16000, "rps": 2500.0, "cpu_us_per_req": 300.0},
            {"target": "kvroute:round_robin", "prompt": 1000, "rps": 4332.0, "cpu_us_per_req": 208.0},
        ]
    }
    assert perf_split._bench_row(b3, "kvroute:round_robin", 1000) == (4332.0, 208.0)
    assert perf_split._bench_row(b3, "kvroute:round_robin", 16000) == (2500.0, 300.0)
    with pytest.raises(RuntimeError, match="no row"):
        perf_split._bench_row(b3, "kvroute:tier_cost", 1000)


def test_the_symbols_column_sums_the_matching_symbols() -> None:
    by_symbol = """# Overhead  Symbol
    30.00%  [.] _PyEval_EvalFrameDefault
     5.50%  [.] long_richcompare
     2.00%  [.] list_richcompare
     1.00%  [k] tcp_ack
     0.50%  [.] PyObject_RichCompare
"""
    assert perf_split.symbol_share(by_symbol, "richcompare|RichCompare") == 8.0
    parts = {**perf_split.split(REPORT), "symbols ~ long_richcompare|list_richcompare": 8.0}
    row = perf_split.table([("fix:tier_cost+tok", 16000, 2700.0, 350.0, parts)]).splitlines()
    assert row[0].endswith("| other | symbols ~ long_richcompare\\|list_richcompare |")
    assert row[0].count("|") - row[0].count("\\|") == row[1].count("|")  # as many cells as the rule
    assert row[2].endswith("| 2.0% (7 µs) | 8.0% (28 µs) |")
