"""The agent's timing statistics of a rank (RankTrack) and when it publishes a summary."""

from __future__ import annotations

import time

import pytest

from transom.faults import MockNvml
from transom.monitor import rank_timing
from transom.monitor import summary_pace as pace
from transom.monitor.node import NodeMonitor
from transom.monitor.rank_timing import RankTrack


def track_of(busies: list[float]) -> RankTrack:
    """A rank whose steps each took `busy` s of its own and waited 0.01 s in the all-reduce."""
    return feed(RankTrack(), [0.05] * rank_timing.WARMUP_STEPS + busies)


def feed(track: RankTrack, busies: list[float]) -> RankTrack:
    """`track` after more steps, each `busy` s of its own and 0.01 s in the all-reduce."""
    sent = track.sent_at or 100.0
    for step, busy in enumerate(busies, start=(track.step or 0) + 1):
        sent += busy + 0.01
        values = {"dur": busy + 0.01, "comm": 0.01, "compute": busy}
        track.add_timing(step, values, track.step, track.sent_at, sent)
        track.first_step = track.first_step or step
        track.step, track.sent_at = step, sent
    return track


def test_hiccups_of_a_busy_machine_are_left_out():
    quiet = track_of([0.05] * 8).view(0.0).busy_s
    hiccups = track_of([0.05, 0.2, 0.05, 0.05, 0.3, 0.05, 0.15, 0.05]).view(0.0).busy_s
    assert quiet == pytest.approx(0.05, abs=1e-4)
    assert hiccups == pytest.approx(0.05, abs=1e-4)  # the 3 highest of 8 are not counted


def test_a_delay_in_half_of_the_steps_shows_where_a_median_would_not():
    stopped_now_and_then = [0.05, 0.12, 0.05, 0.12, 0.05, 0.12, 0.05, 0.12, 0.12]
    view = track_of(stopped_now_and_then).view(0.0)
    assert view.busy_s is not None and view.busy_s > 0.05 + 0.02
    assert view.compute_s is not None and view.compute_s > 0.05 + 0.02


def test_a_stall_every_few_steps_counts_where_the_trimmed_mean_drops_it():
    """Stopped 0.3 s in one step of four (a 300/300 ms duty cycle on 0.1 s steps): the trimmed
    busy time ignores it, the stalls' measure does not; two hiccups in the window count for
    nothing."""
    stalled = track_of(([0.05] * 3 + [0.35]) * 4).view(0.0)
    assert stalled.busy_s == pytest.approx(0.05, abs=1e-4)
    assert stalled.stall_s == pytest.approx(2 * 0.3 / 16, abs=1e-3)  # 4 stalls, 2 ignored
    hiccups = track_of([0.05] * 6 + [0.35] + [0.05] * 6 + [0.35] + [0.05] * 2).view(0.0)
    assert hiccups.stall_s == 0.0


def test_a_stall_every_five_steps_is_held_by_the_longer_window():
    """Stopped about 0.3 s in one step of five (a 300/300 ms duty cycle on 68 ms steps, a
    Trainer job's): 16 steps hold 3 stalls, 1 counted once the 2 hiccups are left out, which is
    the bar itself; 24 steps hold 4, 2 counted."""
    pattern = ([0.05] * 4 + [0.33]) * 5
    assert track_of(pattern[:16]).view(0.0).stall_s == pytest.approx(0.28 / 16, abs=1e-4)
    assert track_of(pattern[:24]).view(0.0).stall_s == pytest.approx(2 * 0.28 / 24, abs=1e-4)


def test_stalls_are_counted_only_over_a_full_window():
    """A generation's first steps are slower by different amounts on each rank: until 16
    comparable steps are in, no stall is measured."""
    slow_start = track_of([0.4, 0.3, 0.3, 0.2, 0.2] + [0.05] * 10)
    assert slow_start.view(0.0).stall_s is None
    assert feed(slow_start, [0.05]).view(0.0).stall_s is not None


def test_a_phase_or_warm_up_step_is_not_timed():
    track = RankTrack()
    assert not track.add_timing(1, {"dur": 0.1}, None, None, 1.0)  # warm-up
    track.first_step = 1
    assert not track.add_timing(9, {"dur": 0.1, "phase": ["checkpoint"]}, 8, 1.0, 2.0)
    assert not track.add_timing(9, {"step": 9}, 8, 1.0, 2.0)  # no timing
    assert track.add_timing(9, {"dur": 0.1}, 8, 1.0, 2.0)


def test_a_summary_goes_out_every_few_steps_while_attentive_as_well_as_every_period():
    monitor = NodeMonitor("nodeT", nvml=MockNvml())
    try:
        monitor.new_generation(1)  # attentive for ATTENTIVE_S: the baseline's first steps
        monitor.collect()
        t = time.monotonic()
        rank = monitor.ranks.setdefault(0, RankTrack())
        rank.step = pace.SUMMARY_STEPS - 1
        assert not monitor.steps_due(t + pace.SUMMARY_MIN_PERIOD_S + 0.01)  # too few new steps
        assert monitor.due(t + pace.SUMMARY_PERIOD_S + 0.01)  # but every period
        rank.step = pace.SUMMARY_STEPS
        assert not monitor.steps_due(t + pace.SUMMARY_MIN_PERIOD_S - 0.01)  # not more often
        assert monitor.steps_due(t + pace.SUMMARY_MIN_PERIOD_S + 0.01)
        monitor.collect()
        t = time.monotonic()
        rank.step = 2 * pace.SUMMARY_STEPS - 1
        assert not monitor.steps_due(t + pace.SUMMARY_MIN_PERIOD_S + 0.01)
        rank.step = 2 * pace.SUMMARY_STEPS
        assert monitor.steps_due(t + pace.SUMMARY_MIN_PERIOD_S + 0.01)
        # Once nothing shifted for ATTENTIVE_S, steps alone are no news: the keep-alive goes.
        assert not monitor.steps_due(t + pace.ATTENTIVE_S + 0.01)
    finally:
        monitor.close()


def test_a_summary_goes_out_at_once_when_a_rank_begins_to_lag():
    monitor = NodeMonitor("nodeT", nvml=MockNvml())
    try:  # stopped from outside from the 9th timed step on: 0.07 s more a step
        monitor.ranks[0] = track_of([0.05] * 8 + [0.12] * 2)
        before = time.monotonic()
        monitor.collect()  # its busy time does not show it yet (the 3 highest are left out)
        later = time.monotonic() + pace.SUMMARY_MIN_PERIOD_S + 0.01
        feed(monitor.ranks[0], [0.12])
        assert not monitor.due(later)  # one step more, its trimmed means as they were
        feed(monitor.ranks[0], [0.12])
        assert 2 < pace.SUMMARY_STEPS and monitor.due(later)  # they moved: no wait for 4 steps
        assert not monitor.due(before + pace.SUMMARY_MIN_PERIOD_S / 2)  # not sooner than this
    finally:
        monitor.close()


def test_a_new_replica_fingerprint_goes_out_in_the_next_summary():
    """The controller compares the ranks' fingerprints of a step (monitor/replicas.py); a rank
    keeps its newest few, so one that waited for the keep-alive could be gone before it went."""
    monitor = NodeMonitor("nodeT", nvml=MockNvml())
    try:
        monitor.ranks[0] = track_of([0.05] * 8)
        monitor.collect()
        t = time.monotonic() + pace.SUMMARY_MIN_PERIOD_S + 0.01
        assert not monitor.steps_due(t)  # steady: nothing new
        monitor.ranks[0].add_fingerprint(10, "00" * 8)
        assert monitor.steps_due(t)
        # ... without waiting out the summaries' period: each step a corruption goes unfound is
        # computed again; FINGERPRINT_MIN_PERIOD_S apart at most.
        assert pace.FINGERPRINT_MIN_PERIOD_S < pace.SUMMARY_MIN_PERIOD_S
        published = time.monotonic()
        assert monitor.steps_due(published + pace.FINGERPRINT_MIN_PERIOD_S + 0.01)
        monitor._published_at = published  # as if a summary just went
        assert not monitor.steps_due(published + pace.FINGERPRINT_MIN_PERIOD_S - 0.01)
        monitor.collect()
        assert not monitor.steps_due(time.monotonic() + pace.SUMMARY_MIN_PERIOD_S + 0.01)
    finally:
        monitor.close()


def test_a_slowdown_that_grows_a_little_at_each_summary_keeps_the_node_attentive():
    """In the generation's first seconds (attentive: a summary every few steps) a rank slowed by
    a bit less than the bar at each summary never shifted from one summary to the next; slower
    by the bar than in the spell's first summary, it extends the spell."""
    for creep in (0.0, 0.008):  # the bar: a quarter of the 0.06 s step, 0.015 s
        monitor = NodeMonitor("nodeT", nvml=MockNvml())
        try:
            monitor.new_generation(1)
            spell_ends = monitor._attentive_until
            monitor.ranks[0] = track_of([0.05] * 8)
            monitor.collect()
            busy = 0.05
            for n in range(3):
                busy += creep
                feed(monitor.ranks[0], [busy] * 8)
                before = time.monotonic()
                monitor.collect()
                if creep and n == 1:  # 0.016 s slower than in the spell's first summary
                    assert monitor._attentive_until >= before + pace.ATTENTIVE_S
                    spell_ends = monitor._attentive_until
                assert monitor._attentive_until == spell_ends, (creep, n)
            feed(monitor.ranks[0], [busy] * pace.SUMMARY_STEPS)
            assert monitor.steps_due(spell_ends - 0.01) and not monitor.steps_due(spell_ends)
        finally:
            monitor.close()
