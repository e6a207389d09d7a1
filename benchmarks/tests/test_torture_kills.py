"""The kill-during-save scenarios' measurements (benchmarks/torture/kills.py, measure.py), on
made-up run directories and events: the loss-continuity check that catches wrong bytes, the
wrong-load count, the timeline counts (fresh starts, rollbacks, shrinks, grows), and the phase
of each kill per victim kind."""

from __future__ import annotations

from pathlib import Path

from benchmarks.torture.kills import loss_mismatches, phases, timeline
from benchmarks.torture.measure import loads
from transom.common import files


class FakeJob:
    def __init__(self, run_dir: Path, events: list[dict] | None = None):
        self.run_dir = run_dir
        self._events = events or []

    def events(self) -> list[dict]:
        return self._events


def write_logs(run_dir: Path, logs: dict[int, str]) -> None:
    for generation, text in logs.items():
        log = run_dir / "logs" / f"g{generation:03d}" / "rank0.log"
        log.parent.mkdir(parents=True)
        log.write_text(text)


def steps(resumed: int, losses: dict[int, str]) -> str:
    lines = [f"[train_gpt] resumed step={resumed} rank=0 t=1.0"]
    lines += [f"step {s} loss {v} t=2.0" for s, v in losses.items()]
    return "\n".join(lines) + "\n"


def test_a_resume_must_continue_the_newest_timeline_that_trained_the_next_step(tmp_path):
    write_logs(
        tmp_path,
        {
            1: steps(0, {1: "4.0", 2: "3.9"}),  # killed before any checkpoint
            2: steps(0, {1: "4.0", 2: "3.9", 3: "3.8", 4: "3.7", 5: "3.6", 6: "3.5", 7: "3.4"}),
            3: steps(6, {7: "3.4", 8: "3.3", 9: "nan", 10: "nan"}),  # a NaN at step 9
            4: steps(6, {7: "3.4", 8: "3.3", 9: "3.2", 10: "3.1"}),  # the rollback
            5: steps(9, {10: "3.1"}),
        },
    )
    assert loss_mismatches(FakeJob(tmp_path)) == []
    write_logs(tmp_path, {6: steps(9, {10: "3.05"})})  # bytes of another timeline
    assert loss_mismatches(FakeJob(tmp_path)) == [
        "generation 6 resumed at 9: loss 3.05 at step 10, generation 5 had 3.1"
    ]


def test_a_resume_from_a_fresh_start_s_step_is_not_compared_with_the_timeline_it_left(tmp_path):
    # The kill torture's trial: generation 3 resumed at 4 from generation 2's timeline; then a
    # fresh start (4) trained steps 1-4 again, and generation 5 resumed from its step 4.
    write_logs(
        tmp_path,
        {
            2: steps(0, {1: "3.6", 2: "3.55", 3: "3.5", 4: "3.45"}),
            3: steps(4, {5: "3.4376", 6: "3.41"}),
            4: steps(0, {1: "3.54", 2: "3.52", 3: "3.51", 4: "3.48"}),
            5: steps(4, {5: "3.4402"}),
        },
    )
    assert loss_mismatches(FakeJob(tmp_path)) == []
    write_logs(tmp_path, {6: steps(4, {5: "3.44"})})  # resumed at 4 again: must match 5's
    assert loss_mismatches(FakeJob(tmp_path)) == [
        "generation 6 resumed at 4: loss 3.44 at step 5, generation 5 had 3.4402"
    ]


def test_a_resume_after_a_nan_is_not_compared_with_the_poisoned_loss(tmp_path):
    write_logs(
        tmp_path,
        {1: steps(0, {7: "3.4", 8: "3.3", 9: "nan"}), 2: steps(8, {9: "3.2"})},
    )
    assert loss_mismatches(FakeJob(tmp_path)) == []


def generation(number: int, t: float, members: int, restore: int | None) -> dict:
    return {
        "kind": "generation",
        "generation": number,
        "time": t,
        "members": [f"node{i}" for i in range(members)],
        "restore_step": restore,
    }


def test_timeline_counts_fresh_starts_rollbacks_shrinks_and_grows():
    events = [
        generation(1, 1.0, 3, None),
        generation(2, 2.0, 3, None),  # fresh
        generation(3, 3.0, 2, 12),  # shrink
        {"kind": "fault", "fault": "nan", "step": 40, "time": 4.0},
        generation(4, 5.0, 2, 39),  # rollback
        generation(5, 5.5, 2, 39),  # a restart after it: no second rollback
        generation(6, 6.0, 3, 45),  # grow
    ]
    assert timeline(events) == {"fresh_starts": 1, "rollbacks": 1, "shrinks": 1, "grows": 1}


def test_phases_count_kills_per_victim_kind_and_phase(tmp_path):
    events = [
        {"kind": "checkpoint", "action": "saved", "step": 9, "rank": 1, "time": 10.0,
         "staged": 9.9},
        {"kind": "checkpoint", "action": "replicated", "step": 9, "rank": 1, "time": 10.2},
        {"kind": "checkpoint", "action": "persisted", "step": 9, "rank": 1, "time": 10.3},
    ]  # fmt: skip
    moments = [
        {"time": 9.95, "rank": 1, "victim": "worker"},
        {"time": 10.1, "rank": 1, "victim": "server"},
        {"time": 10.25, "rank": 1, "victim": "server"},
        {"time": 10.25, "rank": 0, "victim": "agent"},  # another rank's shard: training
        {"time": 12.0, "rank": 1, "victim": "agent"},
    ]
    assert phases(FakeJob(tmp_path, events), moments) == {  # type: ignore[arg-type]
        "worker": {"save": 1},
        "server": {"replication": 1, "persistence": 1},
        "agent": {"training": 2},
    }


def test_a_load_is_wrong_when_its_ranks_disagree_or_it_is_below_the_plan_or_after_a_nan(tmp_path):
    def resumed(generation: int, *steps: int) -> None:
        for rank, step in enumerate(steps):
            log = files.rank_log(tmp_path, generation, rank)
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(f"[train_gpt] resumed step={step} rank={rank} t=1.0\n")

    events = [
        {"time": 1.0, "kind": "generation", "generation": 1},
        {"time": 2.0, "kind": "generation", "generation": 2, "restore_step": 5},
        {"time": 3.0, "kind": "rollback", "rollback_before": 40},
        {"time": 4.0, "kind": "generation", "generation": 3, "restore_step": 30},
    ]
    resumed(1, 0, 0)
    resumed(2, 7, 7)  # newer than the plan's step, every rank the same: right
    resumed(3, 39, 39)  # the newest before the NaN's step: right
    assert loads(tmp_path, events)[:2] == (0, 0)
    resumed(2, 7, 6)  # one rank elsewhere
    assert loads(tmp_path, events)[0] == 1
    resumed(2, 4, 4)  # below the plan's step
    assert loads(tmp_path, events)[0] == 2
    resumed(2, 7, 7)
    resumed(3, 40, 40)  # the poisoned step itself
    assert loads(tmp_path, events)[0] == 2
    resumed(4, 1)  # no event records generation 4's plan
    assert loads(tmp_path, events)[1] == 1
