"""The duplicate allowance's arithmetic (shardfs/read/allowance.py), apart from the reader.

The reader's own tests (test_reader.py) check the same rules through real reads of a served
shard; these check the numbers at their edges, which real reads cannot hit exactly."""

from __future__ import annotations

import time

import pytest

from shardfs.read.allowance import ColdStart, DuplicateAllowance
from shardfs.read.reader import ReaderStats

MB = 1_000_000


def allowance(cold_start_s: float, *, early: float = 0.10, late: float = 0.03,
              patience: float = 0.25) -> DuplicateAllowance:
    return DuplicateAllowance(ReaderStats(), ColdStart(cold_start_s), early_fraction=early,
                              late_fraction=late, late_patience_s=patience)


def end_cold_start(a: DuplicateAllowance) -> None:
    """The cold start began long enough ago to be over (no sleeping through it)."""
    a.cold_start.since = time.monotonic() - a.cold_start.seconds - 1


def test_the_cold_start_runs_for_its_seconds_from_its_beginning() -> None:
    clock = ColdStart(0.2)
    assert not clock.begun and not clock.running() and not clock.over()
    clock.begin()
    assert clock.begun and clock.running() and not clock.over()
    time.sleep(0.25)
    assert not clock.running() and clock.over()


def test_no_cold_start_means_none_runs_and_none_is_over() -> None:
    clock = ColdStart(0)
    clock.begin()
    assert clock.begun and not clock.running() and not clock.over()


@pytest.mark.parametrize("cold_start_s", [0, 60])
def test_the_early_fraction_of_bytes_started_or_queued(cold_start_s: float) -> None:
    a = allowance(cold_start_s)
    a.cold_start.begin()
    assert a.allows(10 * MB, started=100 * MB)
    assert not a.allows(10 * MB + 1, started=100 * MB)
    a.spend(6 * MB)
    assert a.stats.early_member_reads == 1 and a.stats.early_member_bytes == 6 * MB
    assert a.allows(4 * MB, started=100 * MB) and not a.allows(4 * MB + 1, started=100 * MB)
    assert a.allows(14 * MB, started=200 * MB)  # grows with the bytes started
    assert a.late_wait(0.0) == 0.0  # no cold start has ended: the early fraction holds


def test_what_is_left_when_the_cold_start_ends_lapses_and_grows_by_the_late_fraction() -> None:
    a = allowance(1.0)
    a.cold_start.begin()
    a.spend(4 * MB)  # in the cold start: 6 MB of the 10 MB left
    end_cold_start(a)
    assert not a.allows(1, started=100 * MB)  # the first look after the end: the mark
    # 3 % of what was started or queued since: 100 MB more, 3 MB more
    assert a.allows(3 * MB, started=200 * MB)
    assert not a.allows(3 * MB + 1, started=200 * MB)
    a.spend(2 * MB)
    assert a.allows(1 * MB, started=200 * MB) and not a.allows(1 * MB + 1, started=200 * MB)
    # A read that has waited late_patience_s: the early fraction, 10 % of 200 MB, 6 MB spent
    assert a.allows(14 * MB, started=200 * MB, waited=0.25)
    assert not a.allows(14 * MB + 1, started=200 * MB, waited=0.25)


def test_the_mark_is_taken_before_any_spend_after_the_end() -> None:
    """A read past its patience spends from the early fraction; the mark taken at that look
    still holds the spend before it, so what it took counts against the late growth."""
    a = allowance(1.0)
    a.cold_start.begin()
    end_cold_start(a)
    assert a.allows(5 * MB, started=100 * MB, waited=0.3)  # patient: within the 10 %
    a.spend(5 * MB)
    assert not a.allows(1, started=100 * MB)  # the late growth: nothing yet
    assert not a.allows(3 * MB + 1, started=200 * MB)
    assert not a.allows(1, started=200 * MB)  # 3 MB grown, 5 MB spent since the end
    assert a.allows(1 * MB, started=300 * MB)  # 6 MB grown: 1 MB left


def test_a_read_waits_at_most_late_patience_after_the_cold_start() -> None:
    a = allowance(1.0, patience=0.25)
    a.cold_start.begin()
    assert a.late_wait(0.0) == 0.0  # still in the cold start
    end_cold_start(a)
    assert a.late_wait(0.0) == pytest.approx(0.25)
    assert a.late_wait(0.1) == pytest.approx(0.15)
    assert a.late_wait(0.3) == 0.0
