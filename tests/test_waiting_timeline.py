"""The straggler detector on a simulated job on a clock (tests/step_sim.py): the real agents'
timing tracks, summaries published as the agents publish them and the controller's detectors
every tick. It pins how many steps a one-rank slowdown from outside that makes the job 1.5x
slower takes to be found, on 2 and 4 nodes, and that a noisy fault-free job (jitter, hiccups,
slow first steps, checkpoints that every rank waits for) never has a straggler, nor one whose
rank 0 alone saves every few steps once the bootstrap times its saves.
"""

from __future__ import annotations

import random
import statistics

import pytest
import step_sim

THROTTLED_RANK = 1
FAULT_STEP = 60
SEEDS = 20
# What the tests pin, in the job's steps after the fault: the target is 30 times the
# healthy median step time, which on a job 1.5x slower is 20 of its steps.
MEDIAN_STEPS = 13
WORST_STEPS = 20


def throttle_trial(nodes: int, runner, seed: int) -> tuple[float, step_sim.Outcome]:
    """(the job's slowdown, the outcome) of a rank throttled from FAULT_STEP on."""
    job = step_sim.Job(nodes=nodes)
    before = step_sim.simulate(job, FAULT_STEP, seed=seed, stop_at_straggler=False)
    start = sum(before.cycles) + random.Random(seed).uniform(0.0, 0.2)  # the agent's tick
    throttled = step_sim.Job(nodes=nodes, runners={THROTTLED_RANK: runner(start)})
    whole = step_sim.simulate(throttled, FAULT_STEP + 60, seed=seed, stop_at_straggler=False)
    cycles = whole.cycles
    slowdown = sum(cycles[FAULT_STEP : FAULT_STEP + 30]) / sum(
        cycles[FAULT_STEP - 32 : FAULT_STEP - 2]
    )
    return slowdown, step_sim.simulate(throttled, FAULT_STEP + 100, seed=seed)


@pytest.mark.parametrize("nodes", [2, 4])
@pytest.mark.parametrize(
    ("runner", "median_steps", "worst_steps"),
    [
        pytest.param(
            lambda start: step_sim.DutyCycle(start, 1 / 2),
            MEDIAN_STEPS,
            WORST_STEPS,
            id="stopped-half-the-time",
        ),
        pytest.param(
            lambda start: step_sim.CpuQuota(start, 1 / 3.5),
            MEDIAN_STEPS,
            WORST_STEPS,
            id="cpu-quota",
        ),
        # A duty cycle longer than a step (stopped 300 ms of every 600): late in one step of four,
        # by three, which the trimmed busy time drops as hiccups; the stalls' measure
        # (transom.monitor.rank_timing) finds it once more than HICCUPS_IGNORED stalls are in its
        # window. The job is 1.8x slower, so 30 healthy steps are 16.7 of its steps: the median
        # is within that, the worst trials are not.
        pytest.param(
            lambda start: step_sim.DutyCycle(start, 1 / 2, period_s=0.6),
            16,
            24,
            id="stopped-300-of-600-ms",
        ),
    ],
)
def test_an_outside_slowdown_making_the_job_1_5x_slower_is_found_within_bounded_steps(
    nodes, runner, median_steps, worst_steps
):
    slowdowns, latencies = [], []
    for seed in range(SEEDS):
        slowdown, outcome = throttle_trial(nodes, runner, seed)
        slowdowns.append(slowdown)
        assert outcome.straggler is not None, seed
        step, blamed = outcome.straggler
        assert blamed == [f"node{THROTTLED_RANK}"], seed
        latencies.append(step - FAULT_STEP)
    assert statistics.median(slowdowns) >= 1.45  # the job really is about 1.5x slower
    assert statistics.median(latencies) <= median_steps, latencies
    assert max(latencies) <= worst_steps, latencies


@pytest.mark.parametrize("nodes", [2, 4])
def test_a_noisy_fault_free_job_has_no_straggler(nodes):
    job = step_sim.Job(
        nodes=nodes,
        noise=0.3,
        hiccups=0.05,
        hiccup=3.0,
        warmup_steps=15,
        ckpt_every=10,
        ckpt_aftermath=True,
    )
    for seed in range(8):
        outcome = step_sim.simulate(job, 500, seed=seed)
        assert outcome.straggler is None, (seed, outcome.straggler)


def test_a_slowdown_of_every_rank_at_once_blames_no_node():
    start = 8.0
    job = step_sim.Job(nodes=4, runners={r: step_sim.DutyCycle(start, 1 / 2) for r in range(4)})
    outcome = step_sim.simulate(job, 200, seed=1, stop_at_straggler=False)
    assert outcome.straggler is None
    assert outcome.drop is None or outcome.drop[1] == []


def test_rank_0_saving_every_few_steps_is_no_straggler_once_its_saves_are_timed():
    """An unmodified script whose rank 0 alone writes a checkpoint every 3 steps (0.1 s, the
    others waiting): the worker bootstrap times the save and leaves it out of the step's compared
    time (transom.monitor.auto), so no node is named; compared with the save, rank 0 would be."""
    saving = {"nodes": 2, "ckpt_every": 3, "ckpt_s": 0.1, "ckpt_rank0_only": True}
    for seed in range(8):
        timed = step_sim.simulate(step_sim.Job(**saving, saves_timed=True), 300, seed=seed)
        assert timed.straggler is None, (seed, timed.straggler)
    compared = step_sim.simulate(step_sim.Job(**saving), 300, seed=0)
    assert compared.straggler is not None and compared.straggler[1] == ["node0"]
