"""The Locust multi-turn users (loadtest/locustfile.py), headless for a few seconds against a real
router over real simulated engines: every turn's prompt has the workload's exact token count as the
engine counted it, history is resent (later turns hit the cache), and trace replay renders block-id
chains into prompts whose shared ids are shared tokens.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

from kvcore.sim_tokenizer import encode_chat
from loadtest.load import kvroute_router, run_locust
from loadtest.trace_prompts import trace_messages
from sim.fleet import Fleet, FleetProfile

PROFILE = FleetProfile(gpu_blocks=512, cpu_blocks=0, storage_blocks=0, time_scale=50.0)
FIRST, PER_TURN, TURNS = 400, 100, 3


def _turns_csv(prefix: str) -> list[dict[str, str]]:
    with open(f"{prefix}_turns.csv") as fh:
        return list(csv.DictReader(fh))


def _summary_names(stderr: str) -> set[tuple[str, str]]:
    """(type, name) of the entries in Locust's final summary table, printed once every user has
    stopped. Its <prefix>_stats.csv is no substitute: Locust rewrites it once a second and not at
    the end, so it lacks what finished in the last second (a slow machine's last turns)."""
    names = set()
    for line in stderr.splitlines():
        m = re.match(r"(\S+)\s+(.+?)\s+\d+\s+\d+\(\d", line)  # type, name, # reqs, # fails(%)
        if m:
            names.add((m[1], m[2]))
    return names


@pytest.fixture(scope="module")
def router_url(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    workdir = tmp_path_factory.mktemp("locust-fleet")
    with Fleet(workdir) as fleet:
        fleet.start(2, PROFILE)
        with kvroute_router(fleet, "session_affinity", workdir) as url:
            yield url


@pytest.mark.slow
def test_headless_ladder_run_reports_per_turn_metrics(router_url: str, tmp_path: Path) -> None:
    prefix = str(tmp_path / "run")
    ladder = [
        "--first-prompt-tokens", str(FIRST), "--system-prefix-tokens", "64",
        "--tokens-per-turn", str(PER_TURN), "--turns", str(TURNS), "--answer-tokens", "8",
        "--think-time-mean", "0.05",
    ]  # fmt: skip
    proc = run_locust(router_url, 4, 4, "4s", prefix, ladder, capture=True)
    log = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, log
    all_rows = _turns_csv(prefix)
    rows = {int(r["turn"]): r for r in all_rows if r["turn"] != "all"}
    assert set(rows) == set(range(TURNS)), (rows, log)
    overall = all_rows[-1]
    assert overall["turn"] == "all"
    assert int(overall["requests"]) == sum(int(r["requests"]) for r in rows.values())
    for k, row in rows.items():
        # The engine's own prompt count: the ladder's exact size, so history was resent with the
        # real answers (8 tokens, as long as the assumed ones).
        assert int(row["prompt_tokens"]) == int(row["requests"]) * (FIRST + k * PER_TURN), (row, log)
    # A later turn re-reads its history on the same engine (session_affinity): mostly cached.
    assert float(rows[TURNS - 1]["cached_fraction"]) > 0.5, (rows, log)
    names = _summary_names(proc.stderr)
    for k in range(TURNS):
        assert {("POST", f"turn {k}"), ("TTFT", f"turn {k}"), ("ITL", f"turn {k}")} <= names, names
        assert ("USAGE", f"cached tokens turn {k}") in names
    assert "per turn" in proc.stdout


def _summary_posts(stderr: str) -> int:
    """The POSTs in Locust's final summary (every turn sent, warm-up included), over turn numbers."""
    counts = re.findall(r"^POST\s+turn \d+\s+(\d+)\s+\d+\(", stderr, flags=re.MULTILINE)
    return sum(int(c) for c in counts)


@pytest.mark.slow
def test_the_turns_in_flight_at_the_end_are_finished_or_counted_as_cut(
    router_url: str, tmp_path: Path
) -> None:
    """Users with no think time are nearly always mid-turn when a run ends. Cut at once
    (--stop-timeout 0), those turns never reach the percentiles, and the longest waits are the
    likeliest to be cut: ``unfinished`` counts them. With the stop timeout run_locust passes, each
    user finishes the turn it sent: nothing is cut, and every turn sent after --measure-after is
    answered and in the table, the ramp-up's turns not. Catches cut turns that go uncounted, an end
    that cuts, and warm-up turns in the percentiles."""
    ladder = [
        "--first-prompt-tokens", str(FIRST), "--system-prefix-tokens", "64",
        "--tokens-per-turn", str(PER_TURN), "--turns", str(TURNS), "--answer-tokens", "64",
        "--think-time-mean", "0",
    ]  # fmt: skip
    cut_now = [*ladder, "--stop-timeout", "0"]
    cut = run_locust(router_url, 4, 4, "3s", str(tmp_path / "cut"), cut_now, capture=True)
    assert cut.returncode == 0, cut.stderr[-3000:]
    overall = _turns_csv(str(tmp_path / "cut"))[-1]
    assert int(overall["unfinished"]) >= 1, overall
    assert int(overall["sent"]) == int(overall["requests"]) + int(overall["unfinished"]), overall

    warm = [*ladder, "--measure-after", "1"]
    proc = run_locust(router_url, 4, 4, "3s", str(tmp_path / "finished"), warm, capture=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _turns_csv(str(tmp_path / "finished"))
    overall = rows[-1]
    assert int(overall["unfinished"]) == 0 and int(overall["sent"]) == int(overall["requests"]) > 0, rows
    posts = _summary_posts(proc.stderr)
    assert int(overall["sent"]) < posts, (overall, posts)  # the first second's turns are warm-up


@pytest.mark.slow
def test_a_user_sends_no_turn_after_the_run_ends(router_url: str, tmp_path: Path) -> None:
    """At the end a user finishes the turn in flight but not its conversation. With think times of
    10 s on average, most conversations a 2 s run starts are still thinking when it ends; they stop
    there, so fewer last turns are sent than first ones. Catches the earlier end, where each user
    went on with its conversation for up to the stop timeout (30 s) at a load falling as users
    finished, and those turns were measured: every conversation started sent all its turns. (The
    check fails wrongly only if all of at least four conversations sent their three turns within
    2 s: p < 1e-6.)"""
    ladder = [
        "--first-prompt-tokens", str(FIRST), "--system-prefix-tokens", "64",
        "--tokens-per-turn", str(PER_TURN), "--turns", str(TURNS), "--answer-tokens", "8",
        "--think-time-mean", "10",
    ]  # fmt: skip
    proc = run_locust(router_url, 4, 4, "2s", str(tmp_path / "run"), ladder, capture=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["turn"]: r for r in _turns_csv(str(tmp_path / "run"))}
    first, last = int(rows["0"]["sent"]), int(rows.get(str(TURNS - 1), {"sent": 0})["sent"])
    assert first >= 4 and last < first, rows
    assert all(r["unfinished"] == "0" for r in rows.values()), rows


@pytest.mark.slow
def test_headless_agentic_trace_replay_runs(router_url: str, tmp_path: Path) -> None:
    prefix = str(tmp_path / "agentic")
    args = [
        "--workload",
        "agentic",
        "--trace-limit",
        "2",
        "--trace-token-scale",
        "16",
        "--think-scale",
        "0",
        "--max-prompt-tokens",
        "6000",
    ]
    args += ["--max-output-tokens", "4"]
    proc = run_locust(router_url, 2, 2, "3s", prefix, args, capture=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in _turns_csv(prefix) if r["turn"] != "all"]
    assert rows and sum(int(r["requests"]) for r in rows) >= 2, rows
    # Agent calls resend their growing context: some prompt tokens come from the cache.
    assert sum(int(r["cached_tokens"]) for r in rows) > 0, rows


def test_trace_prompts_share_tokens_exactly_where_ids_are_shared() -> None:
    block = 64
    a = encode_chat(trace_messages([1, 2, 3], block, 3 * block + 10))
    b = encode_chat(trace_messages([1, 2, 9], block, 3 * block + 10))
    assert len(a) == 3 * block + 10 + 1  # + the generation prompt token
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    # BOS + role, then two shared blocks: the prompts part inside the third block, not before.
    assert 2 + 2 * block <= common < 2 + 3 * block
