"""Smoke runs of the benchmarks that have no smoke test of their own: they run and print figures."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.bench_split import glibc

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.bench", *args], cwd=REPO, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_bench_index_quick_prints_figures() -> None:
    out = _run("index", "--quick", "--no-memory")
    rate = re.search(r"ingest[^\n]*?([\d,]+)\s*blocks/s", out) or re.search(r"([\d,]{5,})", out)
    assert rate, out
    assert "match" in out and "64 engines" in out, out


def test_bench_engine_small_prints_figures() -> None:
    out = _run("engine", "--steps", "150", "--repeats", "1", "--conversations", "8")
    assert "steps/s" in out, out


def test_bench_unknown_name_is_refused() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.bench", "nope"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "accepted" in proc.stderr


@pytest.mark.slow
def test_bench_peers_quick_measures_direct_and_kvroute(tmp_path: Path) -> None:
    """The B3 side-by-side bench runs wrk against a zero-delay upstream directly and through kvroute,
    and writes its table (the peers are left out of the smoke run: they are a download)."""
    if shutil.which("wrk") is None:
        import pytest

        pytest.skip("wrk (Debian package) is not installed: apt-get install wrk")
    out = _run("peers", "--quick", "--out", str(tmp_path))
    table = (tmp_path / "b3.md").read_text()
    assert table in out or "kvroute:round_robin" in out
    rows = [ln for ln in table.splitlines() if ln.startswith("| 1000 |")]
    assert {r.split("|")[4].strip() for r in rows} == {"direct", "kvroute:round_robin"}, table
    for r in rows:  # every point answered: requests/s > 0 and no errors
        cells = [c.strip() for c in r.split("|")]
        assert float(cells[5].split()[0]) > 0 and cells[-2] == "0", r


@pytest.mark.slow
def test_bench_annotate_prints_both_prompt_shapes() -> None:
    out = _run("annotate", "--sessions", "2", "--calls", "6", "--tokens-per-call", "1200")
    for shape in ("chat", "growing"):
        row = re.search(rf"\| {shape} \| (\d+) \| (\d+) / (\d+) \| (\d+) / (\d+) \| ([\d.]+)x \|", out)
        assert row and int(row.group(1)) > 6000, out


@pytest.mark.slow
def test_bench_speculate_prints_both_patterns_per_checkout() -> None:
    out = _run(
        "speculate", "--requests", "300", "--repeats", "1", "--blocks", "8", "--checkout", f"here={REPO}"
    )
    for pattern in ("same", "fresh"):
        row = re.search(rf"\| 8 \| {pattern} \| here \| ([\d.]+) \[", out)
        assert row and float(row.group(1)) > 0, out


@pytest.mark.slow
def test_bench_split_prints_each_target_and_size() -> None:
    """The bench itself refuses a run where a request was not answered 200, did not reach the
    upstream, or left the router distrusting the engines' prompt counts (loadtest/bench_split.py)."""
    out = _run("split", "--requests", "40", "--repeats", "1", "--prompt-tokens", "300")
    for target in ("round_robin", "tier_cost+tok"):
        row = re.search(rf"\| {re.escape(target)} \| 300 \| (\d+) \[", out)
        assert row and int(row.group(1)) > 0, out


@pytest.mark.slow
@pytest.mark.skipif(not glibc(), reason="glibc's malloc only")
def test_bench_split_keeps_the_heap_so_a_16k_request_does_not_fault_its_buffers_in() -> None:
    """The in-process split must not time page faults the served router does not pay: with glibc's
    default trim, each 16K-token request faulted its ~50 KB buffers in again (~10 a request, ~20-30
    µs). Catches the harness losing its ``keep_heap`` (the ``trim`` run shows the test can fail)."""
    faults = {}
    for heap in ("kept", "trim"):
        out = _run(
            "split",
            "--targets",
            "round_robin",
            "--requests",
            "60",
            "--repeats",
            "1",
            "--prompt-tokens",
            "16000",
            "--heap",
            heap,
        )
        row = re.search(r"\| round_robin \| 16000 \| \d+ \[[\d-]+\] \| ([\d.]+) \|", out)
        assert row, out
        faults[heap] = float(row.group(1))
    assert faults["kept"] < 3 < faults["trim"], faults


def test_the_zero_delay_upstream_counts_prompt_tokens_as_the_sim_tokenizer(tmp_path: Path) -> None:
    """B3's `fast` upstream answers usage.prompt_tokens as a router with the sim tokenizer counts the
    chat. Catches the fixed count it used to answer (60), which failed the router's tokenizer parity
    check within 4 requests and left every B3 tier_cost+tok figure measured on a distrusted index."""
    import httpx

    from kvcore.sim_tokenizer import encode_chat
    from loadtest.bench_peers import FAST_MODEL, chat_body, zero_delay_engines

    with zero_delay_engines("fast", 1, tmp_path) as (up,):
        for tokens in (50, 1000, 1000, 4000):
            body = chat_body(tokens, False, model=FAST_MODEL)
            resp = httpx.post(
                f"{up.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"}
            )
            messages = httpx.Response(200, content=body).json()["messages"]
            assert resp.json()["usage"]["prompt_tokens"] == len(encode_chat(messages)), tokens


def test_bench_peers_targets_name_the_callback_path() -> None:
    """``+cb`` / ``+cbidle`` / ``+cbN`` / ``+nocb`` run kvroute with proxy.callback_path true / "idle" /
    N / false
    (B3 measures the paths of one commit),
    ``+defer`` / ``+nodefer`` with proxy.defer_accounting on / off; catches a suffix read as part
    of the policy name or left on for the plain target, ``+nodefer`` read as ``+defer``."""
    from loadtest.bench_peers import Target

    on = Target.parse("kvroute:tier_cost+tok+cbx2")
    assert (on.policy, on.tokenizer, on.callback_path, on.workers) == ("tier_cost", True, True, 2)
    plain = Target.parse("kvroute:round_robin")  # the checkout's default: no variable set
    assert (plain.policy, plain.tokenizer, plain.callback_path) == ("round_robin", False, None)
    assert Target.parse("kvroute:round_robin+cb").callback_path is True
    assert Target.parse("kvroute:tier_cost+tok+cbidle").callback_path == "idle"
    assert Target.parse("kvroute:tier_cost+tok+nocb").callback_path is False
    below = Target.parse("kvroute:tier_cost+tok+cb4x2")  # the integer gate, as the variable says it
    assert (below.policy, below.tokenizer, below.callback_path, below.workers) == ("tier_cost", True, "4", 2)
    both = Target.parse("kvroute:tier_cost+tok+cb+deferx2")
    assert (both.policy, both.tokenizer, both.callback_path, both.defer_accounting, both.workers) == (
        "tier_cost",
        True,
        True,
        True,
        2,
    )
    # Without a suffix the checkout's default (no variable set); ``+nodefer`` turns it off.
    assert Target.parse("kvroute:round_robin+cb").defer_accounting is None
    off = Target.parse("kvroute:round_robin+tok+nodeferx2")
    assert (off.policy, off.tokenizer, off.defer_accounting, off.workers) == ("round_robin", True, False, 2)


def test_bench_peers_rotates_the_targets_so_each_runs_once_in_every_place() -> None:
    """Catches a fixed order within a repeat (a drift inside a repeat lands on one target every
    time) and a rotation that skips or repeats a target."""
    from loadtest.bench_peers import Target, repeat_order

    targets = [
        Target.parse(t) for t in ("direct", "raw_proxy", "kvroute:round_robin", "kvroute:tier_cost+tok")
    ]
    orders = [[t.spec for t in repeat_order(targets, r)] for r in range(len(targets))]
    assert all(sorted(o) == sorted(t.spec for t in targets) for o in orders)  # every target, once
    for place in range(len(targets)):
        assert len({o[place] for o in orders}) == len(targets)  # each target in each place once
    assert orders[0] == [t.spec for t in targets]  # a single repeat runs them as given
    assert [t.spec for t in repeat_order(targets, len(targets))] == orders[0]


def test_bench_peers_raw_proxy_work_probe_parses() -> None:
    """``raw_proxy+workN`` is the raw proxy with N µs of busy work per request (and plain
    ``raw_proxy`` none); catches the amount lost or a misspelt probe taken for the plain proxy."""
    from loadtest.bench_peers import Target

    probe = Target.parse("raw_proxy+work45.5")
    assert (probe.kind, probe.work_us) == ("raw_proxy", 45.5)
    assert Target.parse("raw_proxy").work_us == 0.0
    with pytest.raises(ValueError):
        Target.parse("raw_proxy+wrk45")


def test_bench_faults_router_config_puts_the_router_on_the_callback_path(tmp_path: Path) -> None:
    """``bench_faults --callback-path [true|false|idle]`` writes a router config the router reads
    with that proxy.callback_path (its default without the option); catches a section or key the
    config does not know, which would leave the fault and input tables measuring another path
    under the label."""
    from loadtest.bench_faults import router_toml
    from router.config import load_config

    engine = {"id": "e0", "url": "http://127.0.0.1:9", "model": "m"}
    for flag, read in ((True, True), (False, False), ("idle", "idle"), (None, "idle")):
        path = tmp_path / f"router-{flag}.toml"
        path.write_text(router_toml([engine], 8000, first_byte_timeout_s=3.0, callback_path=flag))
        assert load_config(path, environ={}).proxy.callback_path == read
        assert type(load_config(path, environ={}).proxy.callback_path) is type(read)


@pytest.mark.slow
def test_bench_peers_runs_a_python_target_with_that_interpreter(tmp_path: Path) -> None:
    """``--python LABEL=PATH``: targets ``LABEL:POLICY`` run this checkout's kvroute with interpreter
    PATH (B3 compares two CPython builds on one code). The interpreter here is a wrapper that
    records its own use, then runs this one; catches the target started with the bench's own
    interpreter (the comparison would measure one build twice), the label not read as kvroute,
    and an interpreter that cannot run the router taken without a clear error."""
    from loadtest.bench_peers import Target, interpreters, start_target, zero_delay_engines

    used = tmp_path / "used"
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {used}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    pythons = interpreters([f"alt={wrapper}"])
    target = Target.parse("alt:round_robin+tok", pythons=pythons)
    assert (target.kind, target.policy, target.tokenizer, target.python) == (
        "kvroute",
        "round_robin",
        True,
        str(wrapper),
    )
    used.unlink()  # (the import check ran it once)
    with (
        zero_delay_engines("fast", 1, tmp_path) as engines,
        start_target(target, engines, tmp_path, tmp_path) as (url, pgid),
    ):
        assert url.startswith("http://127.0.0.1:") and pgid is not None
        assert "router.cli serve" in used.read_text()
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\nexit 3\n")
    broken.chmod(0o755)
    with pytest.raises(ValueError, match="cannot run the router"):
        interpreters([f"bad={broken}"])
    with pytest.raises(ValueError, match="LABEL=PATH"):
        interpreters(["nolabel"])
