"""Zero-code instrumentation, end to end on one node: real worker processes started through the
worker bootstrap (the cold-start path, `python -m transom.control.bootstrap SCRIPT`), real gloo,
an unmodified script (tests/scripts/ddp_toy.py), and the node agent's real monitor receiving
what the bootstrap's hooks send: steps from the optimizer hook, the wait in DDP's gradient
all-reduce and in Python-level collectives, nothing from a script that reports its own steps,
nothing at all with --no-auto-monitor, and the stuck ranks' stacks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import TOY, monitored_ranks, rank_logs, ranks_finished, wait_for

from transom.common import env
from transom.monitor import auto, detectors, eval_phase, stacks

pytestmark = pytest.mark.integration  # real worker processes and gloo


def test_an_unmodified_ddp_script_reports_steps_and_the_wait_for_the_slow_rank(tmp_path):
    steps = 30
    args = ["--steps", str(steps), "--slow-rank", "1", "--slow-s", "0.08", "--ckpt-dir", "ck"]
    with monitored_ranks(tmp_path, TOY, args) as (monitor, procs):
        ranks_finished(procs, tmp_path)
        # One step per optimizer step, counted from 0; the last step of each rank arrived.
        wait_for(lambda: monitor.steps() == {0: steps - 1, 1: steps - 1}, 10, "every step")
        summary, _ = monitor.collect()
    fast, slow = summary.ranks["0"], summary.ranks["1"]
    # Rank 0 waits in DDP's all-reduce for rank 1's extra 80 ms; rank 1 hardly waits.
    assert fast.wait_s is not None and slow.wait_s is not None
    assert fast.wait_s > 0.05 and slow.wait_s < 0.03, (fast, slow)
    # So their compute differs, though their step times are the same (synchronous training).
    assert fast.compute_s is not None and slow.compute_s is not None
    assert slow.compute_s - fast.compute_s > 0.05, (fast, slow)


def test_instrumented_ddp_computes_the_same_bits_as_plain_ddp(tmp_path):
    """Our DDP communication hook must not change a bit: with 3 ranks (not a power of two) a
    hook that divides the bucket by the world size rounds differently from DDP's own reducer."""
    weights = {}
    for name, extra in (("plain", {env.AUTO_MONITOR: "0"}), ("auto", {})):
        run = tmp_path / name
        run.mkdir()
        args = ["--steps", "20", "--ckpt-dir", str(run / "ck")]
        with monitored_ranks(run, TOY, args, extra, world=3) as (monitor, procs):
            ranks_finished(procs, run)
            counted = monitor.counters()["accepted"] > 0
        assert counted == (name == "auto")
        weights[name] = torch.load(run / "ck" / "toy.pt", weights_only=True)["model"]
    assert all(torch.equal(weights["plain"][k], weights["auto"][k]) for k in weights["plain"])


def test_python_level_collectives_are_timed_as_the_wait(tmp_path):
    args = ["--steps", "20", "--slow-rank", "0", "--slow-s", "0.08", "--sync", "allreduce"]
    with monitored_ranks(tmp_path, TOY, [*args, "--ckpt-dir", "ck"]) as (monitor, procs):
        ranks_finished(procs, tmp_path)
        wait_for(lambda: monitor.steps() == {0: 19, 1: 19}, 10, "every step")
        summary, _ = monitor.collect()
    slow, fast = summary.ranks["0"], summary.ranks["1"]
    assert fast.wait_s is not None and slow.wait_s is not None
    assert fast.wait_s > 0.05 and slow.wait_s < 0.03, (fast, slow)


def test_a_rank_that_saves_slowly_is_not_the_one_waited_for(tmp_path):
    """Rank 0 alone writes a checkpoint after every step, 80 ms longer than it takes (a slow
    file system), as a Trainer's rank 0 does: rank 1 waits for it, but the save's time is left
    out of rank 0's compared time, so neither rank's compute stands out."""
    args = ["--steps", "30", "--save-s", "0.08", "--ckpt-dir", "ck"]
    with monitored_ranks(tmp_path, TOY, args) as (monitor, procs):
        ranks_finished(procs, tmp_path)
        wait_for(lambda: monitor.steps() == {0: 29, 1: 29}, 10, "every step")
        summary, _ = monitor.collect()
    saver, other = summary.ranks["0"], summary.ranks["1"]
    assert saver.wait_s is not None and other.wait_s is not None
    assert saver.wait_s > 0.05 and other.wait_s > 0.05, (saver, other)  # its save; the wait
    assert saver.compute_s is not None and other.compute_s is not None
    assert abs(saver.compute_s - other.compute_s) < 0.03, (saver, other)


def long_phase(monitor, phase: str, ranks: tuple[str, ...]):
    """The monitor's summary once `ranks` are all in `phase` and no rank progressed for 2 s."""

    def seen():
        summary, _ = monitor.collect()
        quiet = min((r.step_age or 0.0 for r in summary.ranks.values()), default=0.0)
        phases = [getattr(summary.ranks.get(rank), "phase", None) for rank in ranks]
        return summary if quiet >= 2.0 and phases == [phase] * len(ranks) else None

    return wait_for(seen, 30, f"ranks {', '.join(ranks)} in phase {phase} for 2 s")


def assert_the_phase_spares_a_hang(summary) -> None:
    """The controller's hang rule (a 1 s floor) finds no hang on `summary`, and would on the
    same summary without its phases, once the agent's looks said where each rank is."""
    views = detectors.rank_views({"nodeA": summary}, summary.generation, summary.t)
    assert detectors.hang(views, 1.0) is None
    unmarked = [{**v, "phase": None, "where": "in all_reduce at ddp_toy.py:1"} for v in views]
    found = detectors.hang(unmarked, 1.0)
    assert found is not None and found.type == "hang"


def test_a_save_longer_than_the_hang_timeout_is_a_checkpoint_phase_not_a_hang(tmp_path):
    """Rank 0's save of step 15 takes 4 s, the hang floor is 1 s: the agent hears of a
    checkpoint phase, and the controller's hang rule on that summary finds no hang (the same
    summary without the phase would be one)."""
    args = ["--steps", "25", "--step-delay", "0.02", "--save-s", "4", "--save-s-at", "15"]
    with monitored_ranks(tmp_path, TOY, [*args, "--ckpt-dir", "ck"], hang_floor_s=1.0) as (
        monitor,
        procs,
    ):
        summary = long_phase(monitor, auto.CHECKPOINT_PHASE, ("0",))
        ranks_finished(procs, tmp_path)
    assert_the_phase_spares_a_hang(summary)


def test_an_evaluation_longer_than_the_hang_timeout_is_an_eval_phase_not_a_hang(tmp_path):
    """After step 15 both ranks evaluate for 4 s (the model in eval mode, forward passes and
    all_reduces, no optimizer step), the hang floor is 1 s: the agent hears of the eval phase
    from the model's eval() alone, and the controller's hang rule on that summary finds no hang
    (the same summary without the phase would be one)."""
    args = ["--steps", "25", "--step-delay", "0.02", "--eval-every", "15", "--eval-s", "4"]
    with monitored_ranks(tmp_path, TOY, [*args, "--ckpt-dir", "ck"], hang_floor_s=1.0) as (
        monitor,
        procs,
    ):
        summary = long_phase(monitor, eval_phase.EVAL_PHASE, ("0", "1"))
        ranks_finished(procs, tmp_path)
        # Training went on after it: the phase ended with the model's train().
        wait_for(lambda: monitor.steps() == {0: 24, 1: 24}, 10, "every step")
        after, _ = monitor.collect()
        assert all(r.phase is None for r in after.ranks.values()), after.ranks
    assert_the_phase_spares_a_hang(summary)


EXPLICIT = """
import torch
from transom import monitor
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1000, 1010):
    with monitor.step(step) as s:
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()
        opt.step()
        s.report(loss=loss.item())
print("explicit done", flush=True)
"""


def test_a_script_using_the_explicit_api_is_not_counted_twice(tmp_path):
    script = tmp_path / "explicit.py"
    script.write_text(EXPLICIT)
    with monitored_ranks(tmp_path, script, []) as (monitor, procs):
        ranks_finished(procs, tmp_path)
        wait_for(lambda: monitor.steps() == {0: 1009, 1: 1009}, 10, "every step")
        tracks = dict(monitor.ranks)
    # Only its own step numbers reached the agent: the optimizer hook stood down.
    assert tracks[0].first_step == 1000 and tracks[1].first_step == 1000
    assert len(tracks[0].losses) == 10  # each step once, with its loss


def test_no_auto_monitor_sends_nothing_and_registers_no_stack_dump(tmp_path):
    extra = {env.AUTO_MONITOR: "0", env.STACKS_DIR: ""}
    with monitored_ranks(tmp_path, TOY, ["--steps", "5", "--ckpt-dir", "ck"], extra) as (
        monitor,
        procs,
    ):
        ranks_finished(procs, tmp_path)
        assert monitor.counters()["accepted"] == 0 and monitor.steps() == {}
    assert not list((tmp_path / "logs").glob("*.stacks"))


def test_stuck_ranks_stacks_name_the_stopped_rank_and_where_the_other_waits(tmp_path):
    args = ["--steps", "100000", "--step-delay", "0.02", "--ckpt-dir", "ck"]
    with monitored_ranks(tmp_path, TOY, args, hang_floor_s=2.0, script=str(TOY)) as (
        monitor,
        procs,
    ):
        wait_for(lambda: all((monitor.steps().get(r) or 0) > 20 for r in (0, 1)), 60, "steps")
        os.kill(procs[1].pid, signal.SIGSTOP)
        pids = {0: procs[0].pid, 1: procs[1].pid}

        def where() -> dict[str, str | None]:
            monitor.check(pids, {})
            summary, _ = monitor.collect()
            found = {rank: r.where for rank, r in summary.ranks.items()}
            return found if all(found.values()) else {}

        found = wait_for(where, 20, "the stuck ranks' stacks")
        # The dump interrupted rank 0 inside gloo's wait; continued, both ranks train on.
        stuck_at = monitor.steps()
        os.kill(procs[1].pid, signal.SIGCONT)
        wait_for(
            lambda: all((monitor.steps()[r] or 0) > (stuck_at[r] or 0) + 5 for r in (0, 1)),
            30,
            "both ranks to step again",
        )
        assert all(p.poll() is None for p in procs)
    assert found["1"] == stacks.STOPPED
    # Rank 0 waits for rank 1 inside the backward pass (DDP's gradient all-reduce).
    assert found["0"].startswith("in backward at ddp_toy.py:"), found
    dump = (tmp_path / "logs" / "rank0.stacks").read_text()
    assert "Stack (most recent call first)" in dump  # the main thread's alone (never every one)
    assert "Thread 0x" not in dump
    assert not (tmp_path / "logs" / "rank1.stacks").read_text().count("Stack (most recent")


HOLDS_STILL = """
import signal, sys, time
from transom.control import bootstrap
assert bootstrap.register_stack_dump()
if sys.argv[1] == "reset":
    signal.signal(signal.SIGURG, signal.SIG_DFL)  # as a library resetting every handler would
print("ready", flush=True); time.sleep(60)  # one line: a dump right after "ready" names it too
"""


@pytest.mark.parametrize("reset", [False, True])
def test_a_rank_is_signalled_only_while_it_catches_the_signal(tmp_path, reset):
    """A worker whose handler a library reset is not signalled (and would ignore the signal)."""
    script = tmp_path / "holds_still.py"
    script.write_text(HOLDS_STILL)
    p = subprocess.Popen(
        [sys.executable, str(script), "reset" if reset else "keep"],
        env={**os.environ, env.STACKS_DIR: str(tmp_path), "RANK": "3"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        target = {3: (p.pid, tmp_path / "rank3.stacks")}
        found = stacks.dump_many(target, str(script), timeout_s=10)
        if reset:
            assert found == {} and not stacks.catches(p.pid, stacks.STACKS_SIGNAL)
        else:
            where = stacks.where(found[3])
            assert where == "at holds_still.py:7 in <module>", where  # sleep is C: no frame
        assert p.poll() is None  # alive either way
    finally:
        p.kill()
        p.wait()


USER_HOOK = """
import sys
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
calls = []


def hook(state, bucket):
    calls.append(1)
    return default_hooks.allreduce_hook(state, bucket)


if sys.argv[1] == "before":
    model.register_comm_hook(None, hook)
for step in range(6):
    if sys.argv[1] == "after" and step == 2:
        model.register_comm_hook(None, hook)
    loss = model(torch.ones(2, 4) * (dist.get_rank() + 1)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"calls={len(calls)}", flush=True)
"""


@pytest.mark.parametrize(("when", "calls"), [("before", 6), ("after", 4)])
def test_a_scripts_own_ddp_hook_is_kept_before_or_after_the_first_forward(tmp_path, when, calls):
    """DDP takes one communication hook per model: the script's own, registered before the first
    forward, is left alone (ours is not added); registered after it, it runs inside ours."""
    script = tmp_path / "user_hook.py"
    script.write_text(USER_HOOK)
    with monitored_ranks(tmp_path, script, [when]) as (monitor, procs):
        ranks_finished(procs, tmp_path)
        wait_for(lambda: monitor.steps() == {0: 5, 1: 5}, 10, "every step")
    assert rank_logs(tmp_path).count(f"calls={calls}") == 2, rank_logs(tmp_path)


def test_a_stopped_ranks_place_is_a_summary_due_at_once(tmp_path, monkeypatch):
    """Rank 1 stopped (SIGSTOP), rank 0 waiting for it: once the agent's monitor has collected
    where both are, a summary is due at once to carry it (the controller's hang rule for a
    stopped rank waits for every rank's place), not at the next summary period."""
    from transom.monitor import node

    monkeypatch.setattr(node, "SUMMARY_PERIOD_S", 1e6)  # due only for news
    monkeypatch.setattr(node, "ATTENTIVE_PERIOD_S", 1e6)
    monkeypatch.setattr(detectors, "HEARTBEAT_GAP_S", 1e6)  # no telemetry gap: the place alone
    args = ["--steps", "100000", "--step-delay", "0.02"]
    with monitored_ranks(tmp_path, TOY, args, hang_floor_s=1.0) as (monitor, procs):

        def stepped() -> bool:
            steps = monitor.steps()
            return len(steps) == 2 and all((s or 0) >= 10 for s in steps.values())

        wait_for(stepped, 60, "10 steps of each rank")
        os.kill(procs[1].pid, signal.SIGSTOP)
        pids = {rank: p.pid for rank, p in enumerate(procs)}
        monitor.collect()  # the last summary, before the stop
        assert not monitor.due(time.monotonic())
        monitor.check(pids, {})
        at = monitor.stuck_check_at  # the agent ticks then, not at its next steady tick
        assert at is not None and at <= time.monotonic() + 0.5  # half the 1 s hang floor

        def due():
            monitor.check(pids, {})
            return monitor.due(time.monotonic())

        wait_for(due, 20, "a summary due for the stuck ranks' places")
        again = monitor.stuck_check_at  # collected: the next look while no rank steps
        assert again is not None and again <= time.monotonic() + 0.5
        summary, events = monitor.collect()
        assert events == []
        assert summary.ranks["1"].where == stacks.STOPPED
        assert (summary.ranks["0"].where or "").startswith("in "), summary.ranks["0"]
        assert not monitor.due(time.monotonic())  # published: nothing new
