"""Straggler attribution by waiting and the job's throughput drop, on synthetic step series.

A small simulator plays a synchronous data-parallel job: every step each rank computes, then
waits in the all-reduce until the last rank arrives; a rank may also stall between steps (outside
its step timer) or inside the collective. The agent's medians over a window of steps
(transom.monitor.node) become the views the controller's detectors see.
"""

from __future__ import annotations

import random
import statistics
from collections import deque

from transom.monitor import rank_timing, waiting
from transom.monitor.throughput import ThroughputTracker

COMPUTE_S = 0.10
COMM_S = 0.02


def simulate(nodes, steps, slow=None, noise=0.0, seed=0, every=2, job_factor=1.0):
    """Yield the views of a job of `nodes` nodes (one rank each) every `every` steps (the
    controller looks often; the tracker confirms over CONFIRM_SPAN_STEPS steps).

    `slow(step, rank, rng)` -> (extra compute, extra stall before the step, extra in the
    collective) seconds for that rank at that step.
    """
    rng = random.Random(seed)
    windows = {
        r: {k: deque(maxlen=rank_timing.TIMING_WINDOW) for k in ("dur", "compute", "wait", "busy")}
        for r in range(nodes)
    }
    clock = 0.0
    for step in range(1, steps + 1):
        starts, arrivals, extra_comm = {}, {}, 0.0
        for r in range(nodes):
            compute = COMPUTE_S * job_factor * (1 + noise * rng.uniform(-1, 1))
            if noise and rng.random() < 0.05:
                compute *= 2  # an occasional hiccup on a shared machine
            stall = 0.0
            if slow is not None:
                c, stall, comm = slow(step, r, rng)
                compute += c
                extra_comm += comm
            starts[r] = clock + stall
            arrivals[r] = starts[r] + compute
        end = max(arrivals.values()) + COMM_S * job_factor + extra_comm
        for r in range(nodes):
            w = windows[r]
            w["dur"].append(end - starts[r])
            w["compute"].append(arrivals[r] - starts[r])
            w["wait"].append(end - arrivals[r])
            w["busy"].append(end - clock - (end - arrivals[r]))  # the cycle less the wait
        clock = end
        if step % every == 0 and step >= rank_timing.MIN_TIMING_SAMPLES:
            yield (
                step,
                [
                    {
                        "node": f"node{r}",
                        "rank": r,
                        "step": step,
                        "step_s": statistics.median(windows[r]["dur"]),
                        "compute_s": statistics.median(windows[r]["compute"]),
                        "wait_s": statistics.median(windows[r]["wait"]),
                        "busy_s": statistics.median(windows[r]["busy"]),
                    }
                    for r in range(nodes)
                ],
            )


def first_straggler(series):
    tracker = waiting.StragglerTracker()
    for step, views in series:
        found = tracker.update(views)
        if found is not None:
            return step, found
    return None, None


def throttled(rank, from_step, extra):
    """An outside slowdown of `rank`: `extra` seconds a step, landing at random in its compute,
    before its step (stopped between steps) or inside the collective."""

    def slow(step, r, rng):
        if r != rank or step < from_step:
            return 0.0, 0.0, 0.0
        where = rng.choice(("compute", "compute", "stall", "comm"))
        return (
            extra if where == "compute" else 0.0,
            extra if where == "stall" else 0.0,
            extra if where == "comm" else 0.0,
        )

    return slow


def test_two_nodes_slow_compute_found_on_the_right_node():
    slow = lambda step, r, rng: (0.08 if r == 1 and step >= 40 else 0.0, 0.0, 0.0)  # noqa: E731
    step, found = first_straggler(simulate(2, 120, slow, noise=0.1))
    assert found is not None and found.type == "straggler" and found.nodes == ["node1"]
    assert 40 < step <= 40 + 20
    assert "the others wait for" in found.message


def test_a_rank_stopped_between_steps_is_found_by_its_peers_wait_not_its_compute():
    slow = lambda step, r, rng: (0.0, 0.07 if r == 0 and step >= 30 else 0.0, 0.0)  # noqa: E731
    step, found = first_straggler(simulate(2, 100, slow, noise=0.05))
    assert found is not None and found.nodes == ["node0"]
    ev = found.evidence
    assert abs(ev["compute_excess_s"]) < 0.02 and ev["late_s"] > 0.05  # waiting, not compute
    assert ev["peers_wait_s"] > ev["wait_s"]


def found_after(nodes, seeds=10):
    """Steps from a throttle's start (1.5x slower job) to its straggler, over seeds."""
    latencies = []
    for seed in range(seeds):
        slow = throttled(rank=1, from_step=40, extra=0.06)  # 0.06 s more on a 0.12 s step
        step, found = first_straggler(simulate(nodes, 200, slow, noise=0.1, seed=seed))
        assert found is not None and found.nodes == ["node1"], seed
        latencies.append(step - 40)
    return latencies


def test_outside_throttle_one_and_a_half_times_slower_on_four_nodes():
    latencies = found_after(4)
    assert statistics.median(latencies) <= 20 and max(latencies) <= 40, latencies


def test_outside_throttle_on_two_nodes():
    latencies = found_after(2)
    assert statistics.median(latencies) <= 20 and max(latencies) <= 40, latencies


def test_a_second_slow_node_does_not_hide_the_first():
    """node1 is throttled, then node2 as much 4 steps later: neither stands out from the other,
    but the node named first stays named while it is late, so one of them is found (before,
    12 of these 20 seeds found neither in 260 steps)."""
    first, second = throttled(1, 40, 0.06), throttled(2, 44, 0.06)

    def both(step, r, rng):
        return first(step, r, rng) if r == 1 else second(step, r, rng)

    latencies = []
    for seed in range(20):
        step, found = first_straggler(simulate(4, 300, both, noise=0.1, seed=seed))
        assert found is not None and found.nodes in (["node1"], ["node2"]), seed
        latencies.append(step - 40)
    assert statistics.median(latencies) <= 20, latencies


def test_a_node_named_first_is_not_blamed_while_it_does_not_stand_out_from_one_not_late():
    """node3 is late by a little more than the bar from step 40 and is named; from step 43
    node2 is late by a little less (a loaded machine slowing two of four ranks). node3 no longer
    stands out, and node2 is not late itself, so it is not a second slow node to be hidden by:
    no one is blamed (before, node3 stayed named and was evicted)."""

    def two(step, r, rng):
        late = {3: 0.036, 2: 0.026}.get(r) if step >= (40 if r == 3 else 43) else None
        return 0.0, (late * (1 + 0.05 * rng.uniform(-1, 1))) if late else 0.0, 0.0

    for seed in range(20):
        step, found = first_straggler(simulate(4, 200, two, noise=0.03, seed=seed))
        assert found is None, (seed, step, found and found.message)


def test_no_straggler_in_noise_on_two_and_four_nodes():
    for nodes in (2, 4):
        for seed in range(10):
            step, found = first_straggler(simulate(nodes, 400, noise=0.25, seed=seed))
            assert found is None, (nodes, seed, found and found.message)


def test_no_one_is_blamed_when_every_rank_is_slow_in_the_collective():
    # A stall inside the collective slows every rank the same: nobody arrives late.
    slow = lambda step, r, rng: (0.0, 0.0, 0.05 if r == 0 and step >= 20 else 0.0)  # noqa: E731
    assert first_straggler(simulate(3, 120, slow, noise=0.05))[1] is None


def throughput(series):
    tracker = ThroughputTracker()
    for _, views in series:
        found = tracker.update(views)
        if found is not None:
            return found
    return None


def test_job_wide_slowdown_blames_no_node():
    def series():
        yield from simulate(4, 60, noise=0.05)
        yield from ((60 + s, v) for s, v in simulate(4, 60, noise=0.05, seed=1, job_factor=3.0))

    drop = throughput(series())
    assert drop is not None and drop.type == "throughput_drop"
    assert drop.nodes == [] and drop.evidence["cause"] == "job-wide"
    assert "job-wide" in drop.message


def test_throughput_drop_names_the_node_waited_for():
    slow = lambda step, r, rng: (0.0, 0.25 if r == 3 and step >= 40 else 0.0, 0.0)  # noqa: E731
    drop = throughput(simulate(4, 100, slow, noise=0.05))
    assert drop is not None and drop.nodes == ["node3"]
    assert "node3 (rank 3) is the one the others wait for" in drop.message


def test_throughput_drop_is_raised_once_and_not_without_a_drop():
    assert throughput(simulate(3, 200, noise=0.2)) is None
    tracker = ThroughputTracker()

    def views(step, step_s):
        return [{"node": f"n{r}", "rank": r, "step": step, "step_s": step_s} for r in range(2)]

    raised = [tracker.update(views(s, 0.1 if s < 10 else 0.3)) for s in range(20)]
    assert sum(a is not None for a in raised) == 1
    assert tracker.update(views(20, 0.3)) is None  # not a fresh evaluation


def test_a_straggler_is_confirmed_over_steps_not_over_evaluations():
    views = [
        {"node": "node0", "rank": 0, "step": 9, "step_s": 0.2, "compute_s": 0.1, "wait_s": 0.1},
        {"node": "node1", "rank": 1, "step": 9, "step_s": 0.2, "compute_s": 0.16, "wait_s": 0.0},
    ]  # node1 is late by 0.06 s, over the bar (0.05 s) but not STRONG_BAR_X times over it
    tracker = waiting.StragglerTracker()
    assert tracker.update(views) is None  # the streak begins at step 9
    for _ in range(5):
        assert tracker.update(views) is None  # the same steps again: no new evidence
    for step in (10, 11, 12, 13, 14, 15, 16):
        assert tracker.update([{**v, "step": step} for v in views]) is None  # under 8 steps
    found = tracker.update([{**v, "step": 17} for v in views])
    assert found is not None and found.nodes == ["node1"] and found.step == 17
    assert found.evidence["confirmed_over_steps"] == waiting.CONFIRM_SPAN_STEPS


def test_a_streak_of_short_steps_must_also_last_confirm_min_s_on_the_controllers_clock():
    """Steps of 0.05 s: CONFIRM_SPAN_STEPS of them are 0.4 s, a hiccup of a loaded machine, not
    yet a straggler; once the streak has lasted CONFIRM_MIN_S it is one."""
    views = [
        {"node": "node0", "rank": 0, "step": 9, "step_s": 0.05, "compute_s": 0.03, "wait_s": 0.02},
        {"node": "node1", "rank": 1, "step": 9, "step_s": 0.05, "compute_s": 0.046, "wait_s": 0},
    ]  # node1 is late by 0.016 s, over the bar (0.0125 s)
    tracker = waiting.StragglerTracker()
    clock = 100.0
    for step in range(9, 9 + 100):
        clock += 0.05
        found = tracker.update([{**v, "step": step} for v in views], now=clock)
        if found is not None:
            break
    assert found is not None and found.nodes == ["node1"]
    assert found.evidence["confirmed_over_steps"] > waiting.CONFIRM_SPAN_STEPS
    assert clock - 100.05 >= waiting.CONFIRM_MIN_S > clock - 100.05 - 0.05


def test_a_streak_survives_one_miss_and_ends_at_two_or_at_another_node():
    def views(step, slow):
        return [
            {"node": n, "rank": r, "step": step, "step_s": 0.2, "wait_s": 0.0, "compute_s": c}
            for r, (n, c) in enumerate((("node0", 0.1), ("node1", 0.1), ("node2", 0.1)))
        ] + ([] if slow is None else [{**_SLOW, "node": slow, "step": step}])

    tracker = waiting.StragglerTracker()
    assert tracker.update(views(1, "node3")) is None
    assert tracker.update(views(3, None)) is None  # one miss: the streak goes on
    assert tracker.update(views(5, "node3")) is None
    assert tracker.update(views(9, "node3")).nodes == ["node3"]  # 1..9, named 3 times

    tracker = waiting.StragglerTracker()
    for step, slow in ((1, "node3"), (3, None), (4, None), (5, "node3"), (12, "node3")):
        assert tracker.update(views(step, slow)) is None  # two misses: it began again at 5
    assert tracker.update(views(13, "node3")).nodes == ["node3"]

    tracker = waiting.StragglerTracker()
    for step, slow in ((1, "node3"), (3, "node4"), (9, "node3"), (10, "node3")):
        assert tracker.update(views(step, slow)) is None  # another node ended the streak


# Late by 0.07 s: over the bar (a quarter of the 0.2 s step) but under STRONG_BAR_X times it.
_SLOW = {"rank": 3, "step_s": 0.2, "wait_s": 0.0, "compute_s": 0.17}


def test_a_node_late_by_half_a_step_is_confirmed_sooner_and_only_while_it_stays_so():
    def views(step, compute):
        return [
            {"node": "node0", "rank": 0, "step": step, "step_s": 0.2, "compute_s": 0.1},
            {"node": "node1", "rank": 1, "step": step, "step_s": 0.2, "compute_s": compute},
        ]

    strong = 0.1 + waiting.STRONG_BAR_X * waiting.STRAGGLER_LATE_FRACTION * 0.2 + 0.01
    tracker = waiting.StragglerTracker()
    assert tracker.update(views(10, strong)) is None
    assert tracker.update(views(10 + waiting.STRONG_SPAN_STEPS - 1, strong)) is None
    found = tracker.update(views(10 + waiting.STRONG_SPAN_STEPS, strong))
    assert found is not None and found.nodes == ["node1"]
    assert found.evidence["bar_x"] >= waiting.STRONG_BAR_X
    assert found.evidence["confirmed_over_steps"] == waiting.STRONG_SPAN_STEPS

    span = waiting.STRONG_SPAN_STEPS
    assert 2 * span + 1 < waiting.CONFIRM_SPAN_STEPS  # what follows is confirmed only if strong
    tracker = waiting.StragglerTracker()  # a weaker evaluation between: strong begins again
    for step, compute in ((10, strong), (10 + span, 0.17), (11 + span, strong)):
        assert tracker.update(views(step, compute)) is None
    assert tracker.update(views(10 + 2 * span, strong)) is None  # strong over span - 1 steps
    assert tracker.update(views(11 + 2 * span, strong)) is not None


def test_node_delays_match_medians_over_the_other_nodes_ranks():
    """The sorted-list medians give what statistics.median over the other nodes' ranks gives,
    duplicates, missing waits and several ranks a node included."""
    rng = random.Random(7)
    for _ in range(200):
        views = []
        for n in range(rng.randint(2, 9)):
            for r in range(rng.randint(1, 3)):
                views.append(
                    {
                        "node": f"n{n}",
                        "rank": n * 10 + r,
                        "compute_s": rng.choice([0.1, 0.2, rng.random()]),
                        "busy_s": rng.choice([0.3, rng.random()]),
                        "wait_s": rng.choice([None, 0.05, rng.random()]),
                    }
                )
        got = waiting.node_delays(views)
        for node_id, (delay, rank, evidence) in got.items():
            mine = [v for v in views if v["node"] == node_id]
            others = [v for v in views if v["node"] != node_id]
            waits = [o["wait_s"] for o in others if o["wait_s"] is not None]
            peers_wait = round(statistics.median(waits), 4) if waits else None
            delays = []
            for v in mine:
                excess = v["compute_s"] - statistics.median(o["compute_s"] for o in others)
                late = v["busy_s"] - statistics.median(o["busy_s"] for o in others)
                delays.append((max(late, excess), v["rank"]))
            best = max(d for d, _ in delays)
            assert delay == best
            assert rank == next(r for d, r in delays if d == best)
            assert evidence()["peers_wait_s"] == peers_wait
        assert set(got) == {v["node"] for v in views}


def test_the_detector_state_the_controller_copies_each_tick_does_not_grow_with_the_job():
    import pickle

    from transom.control.tick import Memory
    from transom.monitor.cluster import ClusterView

    def views(n: int, step: int) -> list[dict]:
        timing = {"step_s": 0.1, "busy_s": 0.09, "wait_s": 0.01, "compute_s": 0.08}
        return [{"node": f"node{i}", "rank": i, "step": step, **timing} for i in range(n)]

    sizes = {}
    for n in (8, 1024):
        memory = Memory()
        for step in range(100, 120):
            for detector in memory.detectors:
                detector.update(ClusterView(views(n, step), float(step), 8.0, False))
        sizes[n] = len(pickle.dumps(memory, pickle.HIGHEST_PROTOCOL))
    assert sizes[1024] < sizes[8] + 200  # no per-rank views or keys kept between ticks
    tracker = waiting.StragglerTracker()
    tracker.update(views(4, 1), 1.0, explain=True)  # the controller's debug log asks
    evaluation = tracker.evaluation()
    assert evaluation is not None and set(evaluation["ranks"]) == {0, 1, 2, 3}


def _late_views(step: int, own_step: int | None = None, compute: float = 0.046) -> list[dict]:
    """Steps of 0.05 s; node1 late by `compute` - 0.03 s (the default, 0.016 s: over the
    0.0125 s bar, under STRONG_BAR_X times it), its own step `own_step` (default `step`)."""
    return [
        {"node": "node0", "rank": 0, "step": step, "step_s": 0.05, "compute_s": 0.03},
        {
            "node": "node1",
            "rank": 1,
            "step": step if own_step is None else own_step,
            "step_s": 0.05,
            "compute_s": compute,
        },
    ]


def test_a_streak_whose_steps_confirm_it_is_confirmed_at_a_later_tick_once_its_seconds_passed():
    """No fresh evaluation is needed for the seconds: the controller's next tick confirms it."""
    tracker = waiting.StragglerTracker()
    for n, step in enumerate(range(9, 9 + waiting.CONFIRM_SPAN_STEPS + 1)):
        assert tracker.update(_late_views(step), now=100.0 + 0.01 * n) is None  # 0.08 s lasted
    last = 9 + waiting.CONFIRM_SPAN_STEPS
    assert tracker.pending is not None
    assert tracker.update(_late_views(last), now=100.0 + waiting.CONFIRM_MIN_S - 0.01) is None
    found = tracker.update(_late_views(last), now=100.0 + waiting.CONFIRM_MIN_S)
    assert found is not None and found.nodes == ["node1"] and found.step == last
    assert tracker.update(_late_views(last), now=100.0 + waiting.CONFIRM_MIN_S + 0.5) is None


def test_a_pending_streak_ends_with_the_evaluation_that_no_longer_names_its_node():
    tracker = waiting.StragglerTracker()
    for n, step in enumerate(range(9, 9 + waiting.CONFIRM_SPAN_STEPS + 1)):
        assert tracker.update(_late_views(step), now=100.0 + 0.01 * n) is None
    recovered = 10 + waiting.CONFIRM_SPAN_STEPS
    assert tracker.update(_late_views(recovered, compute=0.03), now=100.2) is None
    assert tracker.pending is None
    assert tracker.update(_late_views(recovered), now=100.0 + 2 * waiting.CONFIRM_MIN_S) is None


def test_strong_evidence_in_two_of_the_ranks_own_windows_is_confirmed_after_strong_min_s():
    strong = 0.03 + waiting.STRONG_BAR_X * waiting.STRAGGLER_LATE_FRACTION * 0.05 + 0.005
    span = waiting.STRONG_SPAN_STEPS
    assert waiting.STRONG_MIN_S < waiting.CONFIRM_MIN_S

    # The named rank's step advanced: its second window said so too.
    tracker = waiting.StragglerTracker()
    assert tracker.update(_late_views(10, compute=strong), now=100.0) is None
    late = _late_views(10 + span, compute=strong)
    assert tracker.update(late, now=100.0 + waiting.STRONG_MIN_S - 0.01) is None
    found = tracker.update(late, now=100.0 + waiting.STRONG_MIN_S)
    assert found is not None and found.nodes == ["node1"]

    # Only the other node's step advanced: the same window again waits CONFIRM_MIN_S.
    tracker = waiting.StragglerTracker()
    assert tracker.update(_late_views(10, own_step=10, compute=strong), now=100.0) is None
    again = _late_views(10 + span, own_step=10, compute=strong)
    assert tracker.update(again, now=100.0 + waiting.STRONG_MIN_S) is None
    assert tracker.update(again, now=100.0 + waiting.CONFIRM_MIN_S - 0.01) is None
    assert tracker.update(again, now=100.0 + waiting.CONFIRM_MIN_S) is not None
