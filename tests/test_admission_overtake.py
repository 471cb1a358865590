"""The admission wait as a priority-queue wait over KV space (issue 27, round q7): the "held" and
"overtake" forms of ``kvcore.core.SequenceLedger.admission_wait_s`` and their plumbing in the DES."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvcore.core import ADMISSION_DECODE_S_PER_TOKEN, ADMISSION_OVERTAKE_WINDOW_S, SequenceLedger
from loadtest.bench_quality import SPLIT_SEPARATION_NAMES, rank_correlation, split_separation, top_share_mean
from sim.des import FleetSimulator, SimConfig
from tests.test_admission_wait import _tight_fleet, _workload

D = ADMISSION_DECODE_S_PER_TOKEN


def _running(book: SequenceLedger, rid: str, prompt: int, output: int, first_s: float) -> None:
    book.place(rid, "e", prompt, output)
    book.first_token(rid, first_s)


def test_free_kv_prices_no_wait_in_every_form() -> None:
    book = SequenceLedger()
    _running(book, "a", 4_000, 1_000, 0.0)
    book.place("w", "e", 3_000, 100)  # waiting, deadline 5 s
    book.set_deadline("w", 5.0, 0.0)
    for form in ("held", "overtake"):
        # 4,000 held (nothing decoded at 0 s) + 3,000 ahead + 3,000 asked = the capacity.
        assert book.admission_wait_s("e", 3_000, 10_000, 0.0, form=form, deadline_s=9.0) == 0.0
        assert book.admission_wait_s("other", 9_000, 10_000, 0.0, form=form, deadline_s=9.0) == 0.0


def test_held_counts_what_running_sequences_hold_now_and_grow_to_not_their_reservation() -> None:
    """A running 4,000 + 1,000 sequence 10 s into its decode holds 4,200 tokens (not its 5,000
    reservation) and ends at 50 s; a waiting one holds nothing. In 10,000 tokens a 5,000-token
    prompt fits now under "held" but not under "reserved" (5,000 + 2,000 reserved beside it); a
    5,900-token one does not fit now (4,200 + 5,900 > 10,000) and waits for the end. Catches: the
    reservation counted as held, waiting sequences counted, or the growth while it waits ignored."""
    book = SequenceLedger()
    _running(book, "a", 4_000, 1_000, 0.0)
    book.place("w", "e", 1_500, 500)
    now = 10.0
    assert book.admission_wait_s("e", 5_000, 10_000, now, form="held") == 0.0
    assert book.admission_wait_s("e", 5_000, 10_000, now, form="reserved") > 0.0
    assert book.admission_wait_s("e", 5_700, 10_000, now, form="held") == 0.0  # 4,200 + 5,700 <= 10,000
    assert book.admission_wait_s("e", 5_900, 10_000, now, form="held") == pytest.approx(1_000 * D - now)


def test_a_waiting_earlier_deadline_sequence_adds_its_blocks_to_a_later_turn_only() -> None:
    """KV of 10,000 tokens, one running sequence holding 4,000 (ends at 50 s), one waiting 3,000-token
    sequence sent with deadline 20 s. A 4,000-token turn with deadline 30 s is served after it: 4,000 +
    3,000 + 4,000 > 10,000, so it waits for the running one to end (40 s from 10 s); with deadline
    15 s it goes first and fits now. "held" ignores the waiting one; a first-come engine (no
    deadline) counts every waiting sequence. Catches: waiting sequences counted whatever their
    deadline (the earlier turn would wait too), or not at all (the later turn would not)."""
    book = SequenceLedger()
    _running(book, "a", 4_000, 1_000, 0.0)
    book.place("w", "e", 3_000, 200)
    book.set_deadline("w", 20.0, 0.0)
    now = 10.0
    assert book.admission_wait_s("e", 4_000, 10_000, now, form="overtake", deadline_s=30.0) == pytest.approx(
        1_000 * D - now
    )
    assert book.admission_wait_s("e", 4_000, 10_000, now, form="overtake", deadline_s=15.0) == 0.0
    assert book.admission_wait_s("e", 4_000, 10_000, now, form="held", deadline_s=30.0) == 0.0
    for deadline_s, wait_s in ((30.0, 1_000 * D - now), (15.0, 0.0)):
        got = book.admission_wait_s("e", 4_000, 10_000, now, form="ahead", deadline_s=deadline_s)
        assert got == pytest.approx(wait_s)
    assert book.admission_wait_s("e", 4_000, 10_000, now, form="overtake") == pytest.approx(1_000 * D - now)


def test_fcfs_engines_count_every_waiting_sequence_and_no_arrival_overtakes() -> None:
    """Without a deadline (first come) the wait does not depend on the deadlines of the waiting
    sequences nor on recent earlier-deadline arrivals."""
    book = SequenceLedger()
    _running(book, "a", 4_000, 1_000, 0.0)
    book.place("w", "e", 3_000, 200)
    before = book.admission_wait_s("e", 4_000, 10_000, 10.0, form="overtake")
    book.set_deadline("w", 1.0, 0.0)
    for i in range(5):
        book.place(f"n{i}", "e", 2_000, 50)
        book.first_token(f"n{i}", 10.0)
        book.finish(f"n{i}", None)
    assert book.admission_wait_s("e", 4_000, 10_000, 10.0, form="overtake") == before


def test_earlier_deadline_arrivals_claim_kv_while_a_late_turn_waits_but_not_past_its_deadline() -> None:
    """Over the last 30 s, 12,000 prompt tokens were sent with a deadline 1 s after their placement
    (400 tokens/s). KV of 10,000 at 10 s: a running sequence holding 4,200 (ends at 50 s) and one
    holding 2,000 (ends at 20 s). A 4,000-token turn with a deadline 2 s ahead is overtaken by them
    (offset 1 < 2) only until its deadline: 800 tokens claimed, and at 20 s 4,400 + 800 + 4,000 fit,
    as under "held". With a deadline 40 s ahead the claims keep growing (4,000 by 20 s) and it
    waits past the last end. With a deadline below their offset, nothing overtakes it. Catches:
    arrivals ignored, counted past the request's deadline, or with later deadlines counted."""
    book = SequenceLedger()
    for i in range(6):
        book.place(f"p{i}", "e", 2_000, 10)
        book.set_deadline(f"p{i}", i + 1.0, float(i))
        book.first_token(f"p{i}", i + 0.5)
        book.finish(f"p{i}", None)  # ended, with no decode sample (the prior stays)
    _running(book, "a", 4_000, 1_000, 0.0)
    _running(book, "b", 2_000, 200, 10.0)
    now = 10.0
    assert book.overtaking_tokens_per_s("e", 2.0, now) == pytest.approx(12_000 / ADMISSION_OVERTAKE_WINDOW_S)
    assert book.overtaking_tokens_per_s("e", 0.5, now) == 0.0
    assert book.admission_wait_s("e", 4_000, 10_000, now, form="overtake", deadline_s=now + 2.0) == (
        pytest.approx(200 * D)
    )
    assert book.admission_wait_s("e", 4_000, 10_000, now, form="overtake", deadline_s=now + 40.0) == (
        pytest.approx(1_000 * D - now)
    )
    assert book.admission_wait_s("e", 4_000, 10_000, now, form="held") == pytest.approx(200 * D)
    # "ahead" counts no arrival: as "held" here (nothing waits), though the deadline lies 40 s ahead.
    assert book.admission_wait_s("e", 4_000, 10_000, now, form="ahead", deadline_s=now + 40.0) == (
        pytest.approx(200 * D)
    )
    assert book.admission_wait_s("e", 5_500, 10_000, now, form="overtake", deadline_s=now + 0.5) == (
        pytest.approx(200 * D)
    )
    assert book.admission_wait_s("e", 5_500, 10_000, now, form="overtake", deadline_s=now + 2.0) == (
        pytest.approx(1_000 * D - now)
    )
    # The window moves on: 40 s later none of them is recent.
    assert book.overtaking_tokens_per_s("e", 2.0, now + 40.0) == 0.0


def test_a_request_that_never_fits_beside_what_is_ahead_waits_past_the_last_end() -> None:
    book = SequenceLedger()
    _running(book, "a", 4_000, 1_000, 0.0)
    book.place("w", "e", 8_000, 300)
    got = book.admission_wait_s("e", 4_000, 10_000, 10.0, form="overtake")
    assert got == pytest.approx(1_000 * D - 10.0 + 300 * D)


def test_an_unknown_form_is_refused_by_name() -> None:
    with pytest.raises(
        ValueError, match="admission form 'queued' is unknown; accepted: reserved, held, ahead, overtake"
    ):
        SequenceLedger().admission_wait_s("e", 1, 10, 0.0, form="queued")
    with pytest.raises(ValueError, match="admission_form 'queued' is unknown"):
        FleetSimulator(_workload(), "tier_cost", _tight_fleet("priority"), SimConfig(admission_form="queued"))


def test_the_forms_change_the_run_on_priority_engines_and_not_on_first_chunk_ones() -> None:
    """Each form changes the routing of a run on KV-bound priority engines (so it is wired in), the
    same configuration reruns to the same TTFTs, and engines with the first-chunk rule are priced as
    without the admission wait whatever the form."""

    def ttfts(form: str | None, reserve_full_isl: bool = True) -> list[float]:
        fleet = _tight_fleet("priority")
        for spec in fleet.engines:
            spec.profile = dataclasses.replace(spec.profile, reserve_full_isl=reserve_full_isl)
        config = SimConfig(seed=3, admission_wait=form is not None, admission_form=form or "reserved")
        return FleetSimulator(_workload(), "tier_cost", fleet, config).run().ttfts_s

    runs = {form: ttfts(form) for form in ("reserved", "held", "ahead", "overtake")}
    assert len({tuple(runs[form]) for form in ("reserved", "held", "overtake")}) == 3
    assert runs["ahead"] != runs["held"]  # (ahead and overtake differ by the arrivals, tested above)
    assert ttfts("overtake") == runs["overtake"]
    assert ttfts("overtake", reserve_full_isl=False) == ttfts(None, reserve_full_isl=False)


def test_rank_correlation_is_spearmans_with_tied_ranks_averaged() -> None:
    """Catches: values correlated instead of ranks (the outlier would pull a Pearson r below 1),
    ties ranked in order of appearance, or a constant series reported as a correlation."""
    assert rank_correlation([1.0, 2.0, 3.0, 1_000.0], [0.1, 0.2, 0.3, 0.4]) == pytest.approx(1.0)
    assert rank_correlation([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    # Ranks (1.5, 1.5, 3) against (1, 2, 3): r = 0.866.
    assert rank_correlation([5.0, 5.0, 7.0], [1.0, 2.0, 3.0]) == pytest.approx(3**0.5 / 2)
    assert math.isnan(rank_correlation([0.0, 0.0, 0.0], [1.0, 2.0, 3.0]))
    assert math.isnan(rank_correlation([1.0], [2.0]))
    with pytest.raises(ValueError, match="series of one length, got 2 and 3"):
        rank_correlation([1.0, 2.0], [1.0, 2.0, 3.0])


def test_split_separation_scores_an_estimate_by_the_turns_it_prices_highest() -> None:
    """200 turns: 190 wait for nothing, 10 wait 1..10 s. An estimate that prices the waiting turns
    in order but the longest one low is caught by the top-1% figure (its top 2 turns waited 9 and
    8 s, not the 10 and 9 s of the longest) and by the correlation over the turns that waited,
    while the correlation over all turns stays high. Catches: the top share taken by the measured
    wait (no estimate could score below the ideal), or the zero-wait turns left in the second
    correlation."""
    splits = {}
    for i in range(200):
        kv = float(i - 189) if i >= 190 else 0.0
        priced = kv if kv < 10.0 else 0.5
        splits[f"r{i}"] = {
            "admission_kv_s": kv,
            "predicted_slot_s": priced,
            "predicted_s": priced,
            "ttft_s": kv,
        }
    got = split_separation(splits)
    names = SPLIT_SEPARATION_NAMES
    assert got[names[4]] == pytest.approx((10.0 + 9.0) / 2)
    assert got[names[3]] == pytest.approx((9.0 + 8.0) / 2)
    assert got[names[0]] > 0.8
    assert got[names[1]] == pytest.approx(rank_correlation([0.5, *range(1, 10)], [10.0, *range(1, 10)]))
    assert got[names[1]] < got[names[0]]
    assert math.isnan(top_share_mean([], "a", "b", 0.01))
