"""The numbers of a run report: pure functions from a run's records to generations, incidents,
per-fault detection and recovery, and goodput.

Definitions (the markdown report repeats them):

* Wall time: from the run's first event to its `succeeded`/`failed` event (the last event, or
  progress sample, when the run did not finish).
* A generation g restores step r_g (0 when it starts fresh). It "trains again" at the first
  sample of g whose step is beyond r_g; it "reaches" step m_g, the highest step a sample of g
  shows (r_g when it shows none). A sample is a step every rank of g had finished by its time
  (transom.report.step_points): a progress record's (the newest step every rank finished, timed
  when the last of them finished it), a fault injected in g (the step its target rank had
  reached), an sdc anomaly (the fingerprinted step every rank had finished: numbered by the
  optimizer from 0, a step at most one below the script's) or a step every rank saved (at the
  last save); none later than the final event (a step first seen after it was reached at the
  generation's pace since its last two samples). The time g reached a step between two samples
  is interpolated linearly between them.
* Incident: the end of generation g followed by generation g+1. Its lost steps are m_g - r_{g+1}
  (steps computed but not kept, to be computed again); lost steps in total sum over incidents.
* Effective training time: the time spent computing the steps that are in the final model. A
  step computed by generation g is kept when no later generation restores a step before it, so g
  keeps its steps up to k_g = min(m_g, r_h for every later generation h) (the last generation keeps
  all it reached). g's effective time runs from the moment it trains again to the moment it
  reached k_g. The rest of the wall time is, exactly:
    start-up   first event -> the first generation trains (processes, rendezvous, first step);
    lost       g reached k_g -> g reached m_g (steps computed again later);
    downtime   g reached m_g -> the next generation that trains, trains again (the fault's
               detection, the restart, restoring the checkpoint, the first step);
    shutdown   the last step -> the final event.
  Effective-training-time ratio = effective training time / wall time. The first step of each
  generation counts as start-up or downtime, since progress only says when a step has finished.
* Per fault (one per `fault` event): detected by the first matching event after the injection
  (crash -> a crash anomaly on its rank, or else the incident naming its node failed; kill -> the
  controller finding the node lost; DETECTORS for the others: hang -> a hang anomaly, slow -> a
  straggler anomaly on its node, nan -> the nan anomaly of the earliest step, log -> a hardware
  anomaly (xid, ecc, ...) on its node, corrupt -> an sdc anomaly naming its rank, or naming none
  (2 replicas); the table is transom.faults.DETECTORS); detection time = detected at - injected
  at; the detected step is the step the detecting anomaly names (an sdc's is the fingerprint's,
  numbered by the optimizer from 0: one below a script's step counted from 1). Recovered when the
  controller acted on the detection (restart, evict or rollback; a crash or a lost node always
  opens an incident) and the next generation trains again beyond its restore step (without
  progress samples: its `running` event); recovery time = detected at -> trains again. A detection
  answered with a warning only is "detected, not recovered".

Events are `transom.common.records.Event` records (parsed and validated where the run directory
is read); a fault event's type and rank are in its `extra` ("fault", "rank"). Progress samples,
status and reference stay plain dicts.

This module must never read files or draw: it maps records to numbers, so tests can check every
number exactly on hand-made records.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import pairwise

from transom.common.records import Event, EventKind
from transom.faults import DETECTORS, NODE_LOST, PREFLIGHT_EXCLUSION
from transom.report.step_points import finite_time, step_points

RECOVERED = "detected+recovered"
NOT_RECOVERED = "detected, not recovered"
NOT_DETECTED = "not detected"
FINAL_KINDS = (EventKind.SUCCEEDED, EventKind.FAILED)
ACTING_DECISIONS = ("restart", "evict", "rollback")


@dataclass
class Generation:
    """One generation of the job: who ran it, where it restored from, how far it trained."""

    number: int
    started_at: float
    members: list[str]
    spares: list[str]
    restore_step: int  # 0 when it started fresh
    running_at: float | None = None
    samples: list[tuple[float, int]] = field(default_factory=list)  # (time, step) with a step

    @property
    def trained_at(self) -> float | None:
        """When its first step beyond the restore step was seen done (None: it never trained)."""
        return next((t for t, s in self.samples if s > self.restore_step), None)

    @property
    def reached_step(self) -> int:
        return max([self.restore_step, *(s for _, s in self.samples)])

    @property
    def reached_at(self) -> float | None:
        """When it reached its highest step (None: it never trained)."""
        if self.trained_at is None:
            return None
        return next(t for t, s in self.samples if s == self.reached_step)

    def training_span(self) -> tuple[float, float]:
        """(trained_at, reached_at) of a generation that trained."""
        trained_at, reached_at = self.trained_at, self.reached_at
        assert trained_at is not None and reached_at is not None, "it never trained"
        return trained_at, reached_at

    def time_of_step(self, step: int) -> float:
        """When it reached `step`, interpolated between samples and clipped to its training time."""
        trained_at, reached_at = self.training_span()
        trained = [(t, s) for t, s in self.samples if t >= trained_at]
        steps = [s for _, s in trained]
        i = bisect_left(steps, step)
        if i == 0:
            return trained[0][0]
        if i == len(trained):
            return reached_at
        (t0, s0), (t1, s1) = trained[i - 1], trained[i]
        return t0 + (t1 - t0) * (step - s0) / (s1 - s0)


def outcome(events: list[Event], status: dict | None) -> dict:
    """The job's final state and its reason."""
    final = next((e for e in reversed(events) if e.kind in FINAL_KINDS), None)
    job = (status or {}).get("job") or {}
    if final is not None:
        state, reason = final.kind.value.upper(), final.message
    else:
        state, reason = (
            job.get("state", "UNKNOWN"),
            "the run has no succeeded/failed event: it did not finish",
        )
    generations = [e for e in events if e.kind == EventKind.GENERATION]
    return {
        "state": state,
        "reason": reason,
        "finished": final is not None,
        "generations": len(generations),
        "restarts": max(0, len(generations) - 1),
    }


def time_span(events: list[Event], progress: list[dict] | None) -> tuple[float, float]:
    """(first event, final event) times; an unfinished run ends at its last record."""
    start = events[0].time
    final = next((e.time for e in events if e.kind in FINAL_KINDS), None)
    if final is None:
        final = max([events[-1].time, *(p["time"] for p in progress or [])])
    return start, final


def launch_s(status: dict | None, start: float) -> float | None:
    """The launch before the run's first event (status.json's `launched_at`, when the launcher
    process started: etcd, the warm template's imports, the agents; not in the wall time), where
    it is a number no later than the first event; None where unknown."""
    at = finite_time((status or {}).get("launched_at"))
    return start - at if at is not None and at <= start else None


def generations(events: list[Event], progress: list[dict] | None) -> list[Generation]:
    """The job's generations in order, each with its progress samples."""
    gens: dict[int, Generation] = {}
    for e in events:
        if e.kind == EventKind.GENERATION and e.generation is not None:
            gens[e.generation] = Generation(
                e.generation,
                e.time,
                list(e.members or []),
                list(e.spares or []),
                e.restore_step or 0,
            )
        elif e.kind == EventKind.RUNNING and e.generation in gens:
            gens[e.generation].running_at = gens[e.generation].running_at or e.time
    restored_steps(events, gens)
    points = step_points(events, progress, [(g.number, g.started_at) for g in gens.values()])
    # A sample written after the job ended (its last step comes with the final status) was
    # reached by the end at the latest: at the generation's pace since its last two samples.
    ended = next((e.time for e in events if e.kind in FINAL_KINDS), math.inf)
    for t, generation, step in sorted(points, key=lambda p: p[0]):
        g = gens.get(int(generation or 0))  # generations count from 1
        if g is not None and (not g.samples or step > g.samples[-1][1]):  # a new step's first
            if t > ended and len(g.samples) >= 2:
                (t0, s0), (t1, s1) = g.samples[-2:]
                t = t1 + (step - s1) * (t1 - t0) / (s1 - s0)
            g.samples.append((min(max(t, g.started_at), ended), step))
    return [gens[n] for n in sorted(gens)]


def restored_steps(events: list[Event], gens: dict[int, Generation]) -> None:
    """Each generation's restore step as its ranks restored it: the plan names the oldest step
    to restore, the ranks may agree on a newer one they all hold (checkpoint/agreement.py). A
    `restored` checkpoint event belongs to the newest generation started before it; the lowest
    step a generation's ranks restored is the one it resumed from."""
    starts = sorted((g.started_at, n) for n, g in gens.items())
    restored: dict[int, int] = {}
    for e in events:
        step = e.step
        if e.kind != EventKind.CHECKPOINT or e.action != "restored" or step is None:
            continue
        i = bisect_left(starts, (e.time, float("inf"))) - 1
        if i >= 0:
            n = starts[i][1]
            restored[n] = min(step, restored.get(n, step))
    for n, step in restored.items():
        if step > gens[n].restore_step:
            gens[n].restore_step = step


def kept_steps(gens: list[Generation]) -> list[int]:
    """k_g for each generation: its highest step that no later generation computes again."""
    kept = []
    for i, g in enumerate(gens):
        later = [h.restore_step for h in gens[i + 1 :]]
        kept.append(min([g.reached_step, *later]))
    return kept


def incidents(events: list[Event], gens: list[Generation], have_progress: bool) -> list[dict]:
    """One per generation that a next generation followed: what ended it and the steps lost."""
    out = []
    for g, nxt in pairwise(gens):
        between = [e for e in events if g.started_at <= e.time <= nxt.started_at]
        diagnosis = next((e for e in reversed(between) if e.kind == EventKind.DIAGNOSIS), None)
        incident = next((e for e in reversed(between) if e.kind == EventKind.INCIDENT), None)
        cause = (
            diagnosis.cause
            if diagnosis is not None
            else incident.message
            if incident is not None
            else None
        )
        lost = max(0, g.reached_step - nxt.restore_step) if have_progress else None
        out.append(
            {
                "generation": g.number,
                "next_generation": nxt.number,
                "cause": cause,
                "interrupted_step": g.reached_step if have_progress else None,
                "interrupted_at": g.reached_at,
                "restore_step": nxt.restore_step,
                "lost_steps": lost,
                "trains_again_at": nxt.trained_at,
            }
        )
    return out


def goodput(
    start: float,
    end: float,
    gens: list[Generation],
    incident_rows: list[dict],
    have_progress: bool,
    reference: dict | None,
) -> dict:
    """Wall time, steps, and the wall time split into effective, start-up, lost, downtime and
    shutdown."""
    wall = end - start
    unknown = "steps_completed effective_training_s effective_ratio_x startup_s lost_compute_s"
    unknown += " downtime_s shutdown_s lost_steps reference_wall_s slowdown_x"
    result: dict = {"wall_s": wall, **dict.fromkeys(unknown.split())}
    result["progress_available"] = have_progress
    if reference and reference.get("wall_s"):
        reference_wall = float(reference["wall_s"])
        result["reference_wall_s"] = reference_wall
        result["slowdown_x"] = wall / reference_wall
    if not have_progress:
        return result
    result["lost_steps"] = sum(i["lost_steps"] for i in incident_rows)
    result["steps_completed"] = gens[-1].reached_step if gens else 0
    trained = [
        (g, k) for g, k in zip(gens, kept_steps(gens), strict=True) if g.trained_at is not None
    ]
    if not trained:
        return result
    effective = lost = downtime = 0.0
    for n, (g, k) in enumerate(trained):
        trained_at, reached_at = g.training_span()
        kept_until = g.time_of_step(k) if k > g.restore_step else trained_at
        kept_until = min(max(kept_until, trained_at), reached_at)
        effective += kept_until - trained_at
        lost += reached_at - kept_until
        if n + 1 < len(trained):
            downtime += trained[n + 1][0].training_span()[0] - reached_at
    result.update(
        effective_training_s=effective,
        effective_ratio_x=effective / wall if wall > 0 else None,
        startup_s=trained[0][0].training_span()[0] - start,
        lost_compute_s=lost,
        downtime_s=downtime,
        shutdown_s=end - trained[-1][0].training_span()[1],
    )
    return result


def _detected_at(event: Event) -> float:
    """When the problem was seen: the observer's time (anomalies) or the incident's start."""
    if event.observed is not None:
        return event.observed
    return event.detection if event.detection is not None else event.time


def _names(event: Event, node: str | None, rank: int | None) -> bool:
    if rank is not None and event.ranks:
        return rank in event.ranks
    return node in (event.nodes or [])


def fault_type(fault: Event) -> str:
    """A fault event's fault type (`extra["fault"]`, e.g. "crash"; "?" when it names none)."""
    kind = fault.extra.get("fault")
    return kind if isinstance(kind, str) else "?"


def fault_rank(fault: Event) -> int | None:
    """The rank a fault event's fault struck (`extra["rank"]`; None when it names none)."""
    rank = fault.extra.get("rank")
    return rank if type(rank) is int else None


def find_detection(fault: Event, events: list[Event]) -> Event | None:
    """The first event after the injection that detected `fault` (see the module docstring)."""
    kind, node, rank, at = fault_type(fault), fault.node, fault_rank(fault), fault.time
    after = [e for e in events if _detected_at(e) >= at]
    if PREFLIGHT_EXCLUSION in DETECTORS.get(kind, ()):  # slow_preflight: excluded before training
        excluded = [e for e in after if e.kind == EventKind.EVICT and e.preflight is not None]
        return next((e for e in excluded if e.node == node), None)
    if NODE_LOST in DETECTORS.get(kind, ()):  # kill: the controller finds the node lost
        for e in after:
            # the incident, diagnosis or eviction that names `node` among the lost members
            if e.kind in (EventKind.INCIDENT, EventKind.DIAGNOSIS, EventKind.EVICT) and node in (
                e.lost or []
            ):
                return e
        return None
    anomalies = [
        e for e in after if e.kind == EventKind.ANOMALY and e.type in DETECTORS.get(kind, ())
    ]
    if kind == "crash":  # the agent's crash anomaly, or else the incident its failure report opened
        anomalies = [e for e in anomalies if _names(e, node, rank)] + [
            e for e in after if e.kind == EventKind.INCIDENT and node in (e.failed or [])
        ]
    elif kind in ("slow", "log"):
        anomalies = [e for e in anomalies if _names(e, node, None)]
    elif kind == "corrupt":  # the sdc that names its rank, or one with 2 replicas that names none
        anomalies = [e for e in anomalies if not e.nodes or _names(e, node, rank)]
    elif kind == "nan" and anomalies:

        def step(e: Event) -> float:
            return e.step if e.step is not None else math.inf

        first_step = min(map(step, anomalies))
        anomalies = [e for e in anomalies if step(e) == first_step]
    return min(anomalies, key=_detected_at, default=None)


def _acted_on(detection: Event, events: list[Event], until: float) -> bool:
    """Whether the controller answered the detection with a restart, an eviction or a rollback."""
    if detection.kind != EventKind.ANOMALY or detection.type == "crash":
        return True  # a crashed worker or a lost node always opens an incident
    for e in events:
        if (
            e.kind == EventKind.DECISION
            and _detected_at(detection) <= e.time <= until
            and e.action in ACTING_DECISIONS
            and (
                e.anomaly == detection.id
                or (
                    e.anomaly_type == detection.type
                    and set(e.nodes or []) & set(detection.nodes or [])
                )
            )
        ):
            return True
    return False


def _detected_by(detection: Event) -> str:
    if detection.kind == EventKind.EVICT and detection.preflight is not None:
        return PREFLIGHT_EXCLUSION
    if detection.kind == EventKind.ANOMALY:
        return f"{detection.type} anomaly"
    if detection.kind == EventKind.INCIDENT and detection.failed and not detection.lost:
        return "worker failure (incident)"
    return NODE_LOST


def fault_rows(
    events: list[Event], gens: list[Generation], incident_rows: list[dict], have_progress: bool
) -> list[dict]:
    """One row per `fault` event: detection, recovery, lost steps and status."""
    rows = []
    lost_by_next = {i["next_generation"]: i["lost_steps"] for i in incident_rows}
    for f in (e for e in events if e.kind == EventKind.FAULT):
        row = {
            "id": f.id,
            "type": fault_type(f),
            "node": f.node,
            "rank": fault_rank(f),
            "step": f.step,
            "generation": f.generation,
            "injected_at": f.time,
            "detected_by": None,
            "detected_at": None,
            "detection_s": None,
            "detected_step": None,
            "recovered_in_generation": None,
            "running_at": None,
            "recovered_at": None,
            "recovery_s": None,
            "lost_steps": None,
            "status": NOT_DETECTED,
        }
        rows.append(row)
        detection = find_detection(f, events)
        if detection is None:
            continue
        detected = _detected_at(detection)
        row.update(
            detected_by=_detected_by(detection),
            detected_at=detected,
            detection_s=detected - f.time,
            detected_step=detection.step,
            status=NOT_RECOVERED,
        )
        nxt = next(
            (g for g in gens if g.started_at >= detected and g.number > (f.generation or 0)),
            None,
        )
        if nxt is None or not _acted_on(detection, events, nxt.started_at):
            continue
        back = nxt.trained_at if have_progress else nxt.running_at
        if back is None:
            continue
        row.update(
            recovered_in_generation=nxt.number,
            running_at=nxt.running_at,
            recovered_at=back,
            recovery_s=back - detected,
            lost_steps=lost_by_next.get(nxt.number),
            status=RECOVERED,
        )
    return rows


def fault_counts(rows: list[dict]) -> dict:
    return {
        "total": len(rows),
        "recovered": sum(r["status"] == RECOVERED for r in rows),
        "not_recovered": sum(r["status"] == NOT_RECOVERED for r in rows),
        "not_detected": sum(r["status"] == NOT_DETECTED for r in rows),
    }


def analyse(
    events: list[Event], progress: list[dict] | None, status: dict | None, reference: dict | None
) -> dict:
    """All the report's numbers (JSON-ready, times as unix seconds)."""
    have_progress = bool(progress)
    start, end = time_span(events, progress)
    gens = generations(events, progress)
    incident_rows = incidents(events, gens, have_progress)
    rows = fault_rows(events, gens, incident_rows, have_progress)
    return {
        "outcome": outcome(events, status),
        "start_at": start,
        "end_at": end,
        "goodput": {
            **goodput(start, end, gens, incident_rows, have_progress, reference),
            "launch_s": launch_s(status, start),
        },
        "faults": rows,
        "fault_counts": fault_counts(rows),
        "generations": [
            {
                "generation": g.number,
                "started_at": g.started_at,
                "running_at": g.running_at,
                "trained_at": g.trained_at,
                "members": g.members,
                "spares": g.spares,
                "restore_step": g.restore_step,
                "reached_step": g.reached_step if have_progress else None,
            }
            for g in gens
        ],
        "incidents": incident_rows,
    }
