"""The epoch model of bench/epochsim.py keeps its books: every byte of the dataset arrives
once (plus, for early member reads, at most the duplicate allowance), no epoch beats the
link, and priority that costs nothing beats fair sharing (the model's one claim that
docs/benchmarks-notes.md leans on)."""

from __future__ import annotations

from bench.epochsim import Model, Setup, run_chunks, run_split, run_streams

SMALL = Setup(files=600)


def test_whole_shard_streams_fetch_each_byte_once_and_no_faster_than_the_link():
    r = run_streams(SMALL, seed=1, budget=0.0)
    assert abs(r.fetched_over_read - 1.0) < 0.01
    assert r.epoch >= r.link_time
    assert r.requests == len(Model(SMALL, 1).shard_len)


def test_early_member_reads_stay_within_their_allowance():
    r = run_streams(SMALL, seed=1, budget=0.10)
    assert 1.0 < r.fetched_over_read <= 1.10 + 0.01
    assert r.epoch >= r.link_time


def test_ranged_chunks_fetch_each_byte_once():
    r = run_chunks(SMALL, seed=2, inflight=8, chunk=1e6)
    assert abs(r.fetched_over_read - 1.0) < 0.01
    assert r.epoch >= r.link_time
    assert r.requests > run_streams(SMALL, seed=2, budget=0.0).requests


def test_free_instant_priority_beats_fair_sharing():
    fair = run_streams(SMALL, seed=3, budget=0.0)
    ideal = run_streams(SMALL, seed=3, slots=10**6, budget=0.0, prio=True)
    assert ideal.epoch < fair.epoch
    assert ideal.read_by_link_time > fair.read_by_link_time


def test_split_gets_fetch_each_byte_about_once():
    """Splitting GETs at members read early fetches no member twice (only members of shards
    still waiting for a slot, within the allowance), and is no faster than the link."""
    r = run_split(SMALL, seed=4)
    assert r.fetched_over_read <= 1.0 + 0.10 + 0.01
    assert r.epoch >= r.link_time
    assert r.requests > len(Model(SMALL, 4).shard_len)  # the splits' GETs
    skip = run_streams(SMALL, seed=4, skip=True)
    assert abs(skip.fetched_over_read - 1.0) < 0.01
    assert skip.epoch >= skip.link_time
