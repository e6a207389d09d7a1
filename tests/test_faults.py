"""The faults package: the fault table, the schedule, the agent's and the worker's hooks.

Fast unit tests: a dict stands in for etcd, no process is started (crash/hang/kill signal real
processes and are covered end to end in test_monitor_e2e.py and test_demo.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import psutil
import pytest

from transom.common import anomaly_types, keys
from transom.common.record_base import RecordError
from transom.faults import (
    AGENT_FAULTS,
    DEFAULT_LOG_LINE,
    DETECTORS,
    FAULT_TYPES,
    NODE_LOST,
    RANDOM_TYPES,
    WORKER_FAULTS,
    Fault,
    FaultInjector,
    WorkerFaults,
    cpu_quota,
    parse_schedule,
    parse_worker_faults,
)
from transom.faults.schedule import read_fault
from transom.faults.throttle import throttle
from transom.job_spec import ConfigError, JobSpec
from transom.monitor import patterns
from transom.testing.jobs import wait_for


class DictStore:
    """The part of `Store` the injector uses, over a dict."""

    def __init__(self) -> None:
        self.data: dict[str, dict] = {}

    def create(self, key: str, value: dict) -> bool:
        if key in self.data:
            return False
        self.data[key] = value
        return True

    def put(self, key: str, value: dict) -> None:
        self.data[key] = value

    def get_prefix(self, prefix: str) -> dict[str, dict]:
        return {k[len(prefix) :]: v for k, v in self.data.items() if k.startswith(prefix)}

    def events(self) -> list[dict]:
        return [v for k, v in sorted(self.data.items()) if k.startswith(keys.EVENTS)]


def test_the_table_names_a_place_and_detectors_for_every_fault_type():
    assert set(DETECTORS) == set(FAULT_TYPES)
    assert DETECTORS["crash"] == ("crash",) and DETECTORS["hang"] == ("hang",)
    assert DETECTORS["slow"] == ("straggler",) and DETECTORS["nan"] == ("nan",)
    assert DETECTORS["kill"] == (NODE_LOST,)
    assert set(AGENT_FAULTS) == {"crash", "hang", "log", "kill", "throttle", "quota"}
    assert DETECTORS["throttle"] == DETECTORS["quota"] == ("straggler",)
    assert set(WORKER_FAULTS) == {"slow", "nan", "corrupt"}
    assert RANDOM_TYPES == ("crash", "hang", "slow", "nan", "log")  # the seeded draw's order


def test_a_log_fault_is_detected_by_the_hardware_types_its_line_raises():
    hardware = {p.type for p in patterns.PATTERNS if p.hardware}
    assert set(DETECTORS["log"]) == hardware == set(anomaly_types.HARDWARE)
    matched = patterns.classify(DEFAULT_LOG_LINE)
    assert matched is not None and matched.type in DETECTORS["log"]


def test_slow_preflight_needs_a_node_and_no_step():
    (fault,) = parse_schedule("slow_preflight@node=node1:factor=5", 4)
    assert fault.type == "slow_preflight" and fault.node == "node1" and fault.factor == 5
    for bad in ("slow_preflight@factor=5", "slow_preflight@node=n:factor=1", "slow@rank=1"):
        with pytest.raises(ConfigError):
            parse_schedule(bad, 4)


def test_preflight_fault_fires_once_on_its_node_only():
    store = DictStore()
    schedule = parse_schedule("slow_preflight@node=node1:factor=5", 4)
    assert FaultInjector(store, "node0", schedule).on_preflight() == 1.0
    assert FaultInjector(store, "node1", schedule).on_preflight() == 5.0
    assert FaultInjector(store, "node1", schedule).on_preflight() == 1.0  # a rejoin: fired before
    (event,) = store.events()
    assert event["kind"] == "fault" and event["fault"] == "slow_preflight"
    assert event["node"] == "node1" and "(x5.0)" in event["message"]


def test_workers_get_their_unfired_worker_faults_only():
    store = DictStore()
    schedule = parse_schedule(
        "nan@step=3:rank=1,slow@step=5:node=node0:factor=2,crash@step=2:rank=1,nan@step=4:rank=2", 4
    )
    injector = FaultInjector(store, "node0", schedule)
    given = json.loads(injector.on_generation(1, [0, 1]))
    assert sorted((f["type"], f["rank"]) for f in given) == [("nan", 1), ("slow", 0), ("slow", 1)]
    store.create(keys.fault_fired("f0"), {})  # the nan fired in an earlier generation
    given = json.loads(injector.on_generation(2, [0, 1]))
    assert sorted(f["type"] for f in given) == ["slow", "slow"] and injector.generation == 2


def test_an_agent_fault_fires_at_its_step_once(tmp_path):
    store = DictStore()
    injector = FaultInjector(store, "node0", parse_schedule("log@step=5:rank=1", 4))
    log = tmp_path / "rank1.log"
    log.write_text("")
    injector.on_agent_tick({0: 9, 1: 4}, {0: 1, 1: 2}, {0: tmp_path / "x", 1: log})
    assert log.read_text() == "" and not store.events()
    for _ in range(2):
        injector.on_agent_tick({0: 9, 1: 5}, {0: 1, 1: 2}, {0: tmp_path / "x", 1: log})
    assert log.read_text() == DEFAULT_LOG_LINE + "\n"
    (event,) = store.events()
    assert (event["fault"], event["rank"], event["step"]) == ("log", 1, 5)


def test_a_worker_report_is_checked_against_the_schedule():
    store = DictStore()
    schedule = parse_schedule("nan@step=3:rank=1", 4)
    injector = FaultInjector(store, "node0", schedule)
    assert not injector.on_worker_fired({"id": "f9", "type": "nan", "step": 1}, 1, 1)
    assert not injector.on_worker_fired({"id": "f0", "type": "slow", "step": 3}, 1, 3)
    assert not injector.on_worker_fired({"id": "f0"}, 1, 3)
    assert not injector.on_worker_fired("junk", 1, 3)  # type: ignore[arg-type]
    assert injector.on_worker_fired(schedule[0].to_dict(), 1, 3, when=12.5)
    assert not injector.on_worker_fired(schedule[0], 1, 4)
    (event,) = store.events()
    assert event["time"] == 12.5 and event["step"] == 3


def test_the_worker_hooks_fire_each_fault_once_at_its_step():
    announced = []
    faults = parse_worker_faults(
        json.dumps(
            [
                {"id": "f0", "type": "nan", "step": 2, "rank": 1},
                {"id": "f1", "type": "slow", "step": 3, "rank": 1, "factor": 4},
                {"id": "f2", "type": "nan", "step": 1, "rank": 0},  # another rank's
                {"id": "f3", "type": "crash", "step": 1, "rank": 1},  # the agent's, not ours
                {"id": "f4", "type": "nope", "step": 1},
                {"id": "f5", "type": "nan", "step": "1", "rank": 1},  # a step that is no int
                {"type": "nan", "step": 1, "rank": 1},  # no id
                "junk",
            ]
        ),
        rank=1,
    )
    hooks = WorkerFaults(faults, lambda f, step: announced.append((f["id"], step)))
    losses = []
    for step in range(1, 6):
        hooks.on_step(step)
        losses.append(hooks.on_loss(step, 1.0))
        if step == 2:
            assert hooks.state.slow_factor == 1.0
    assert [math.isnan(x) for x in losses] == [False, True, False, False, False]
    assert hooks.state.slow_factor == 4.0 and announced == [("f0", 2), ("f1", 3)]
    assert parse_worker_faults("not json", 1) == [] and parse_worker_faults(None, 1) == []


def test_fault_schedule_parsing():
    faults = parse_schedule(
        "crash@step=40:rank=1,hang@step=80,slow@step=120:node=node2:factor=2.5", 4, seed=1
    )
    assert [(f.type, f.step, f.rank, f.node) for f in faults][0] == (
        "crash",
        40,
        1,
        None,
    )
    assert faults[1].rank in range(4) and faults[2].node == "node2" and faults[2].factor == 2.5
    assert len({f.id for f in faults}) == 3
    (duty,) = parse_schedule("throttle@step=5:rank=0:factor=2:period=0.6", 2)
    assert duty.period == 0.6 and read_fault(duty.to_dict()).period == 0.6
    assert parse_schedule("throttle@step=5:rank=0", 2)[0].period is None
    for forged in ("nan", "inf", -1, "x"):  # a spec read back from etcd is not trusted
        with pytest.raises(RecordError):
            read_fault({**duty.to_dict(), "period": float(forged) if forged != "x" else forged})
    assert parse_schedule("random:count=5:steps=10-20", 4, seed=3) == parse_schedule(
        "random:count=5:steps=10-20", 4, seed=3
    )
    assert all(10 <= f.step <= 20 for f in parse_schedule("random:count=5:steps=10-20", 4, seed=3))
    for bad in (
        "explode@step=3",
        "crash@rank=1",
        "crash@step=x",
        "crash@step=3:rank=9",
        "slow@step=3:factor=0.5",
        "crash",
        "throttle@step=3:period=0",
        "throttle@step=3:period=x",
        "throttle@step=3:period=60",
    ):
        with pytest.raises(ConfigError):
            parse_schedule(bad, 4)


def test_schedules_are_those_of_the_old_parser():
    """Same seed, same schedule as transom/monitor/faults.py drew before the move."""
    drawn = parse_schedule("random:count=6:steps=10-90", 4, seed=7)
    assert [(f.type, f.step, f.rank) for f in drawn] == [
        ("slow", 29, 3),
        ("crash", 19, 0),
        ("slow", 84, 0),
        ("log", 37, 0),
        ("crash", 65, 3),
        ("crash", 40, 0),
    ]


def test_a_new_fault_type_is_one_class_and_one_registration(monkeypatch, tmp_path):
    from transom.faults.fault_type import AGENT, AgentTarget, FaultType

    class Touch(FaultType):
        name = "touch"
        where = AGENT
        detected_by = ("touched",)
        description = "a file appears next to the worker's log"

        def fire_agent(self, fault: Fault, target: AgentTarget) -> None:
            (target.log_path.parent / "touched").write_text(str(target.pid))

    monkeypatch.setitem(FAULT_TYPES, Touch.name, Touch())  # the registration line
    schedule = parse_schedule("touch@step=2:rank=0", 2)
    store = DictStore()
    FaultInjector(store, "node0", schedule).on_agent_tick({0: 2}, {0: 42}, {0: tmp_path / "r0"})
    assert (tmp_path / "touched").read_text() == "42"
    assert store.events()[0]["fault"] == "touch"


@pytest.mark.integration
def test_throttle_stops_and_continues_the_worker_from_outside_until_it_exits():
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        thread = throttle(child.pid, run_fraction=0.5, period_s=0.05)
        states = []
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            states.append(psutil.Process(child.pid).status())
            time.sleep(0.005)
        stopped = states.count(psutil.STATUS_STOPPED) / len(states)
        assert 0.25 < stopped < 0.75, stopped  # stopped about half of the time
    finally:
        child.kill()
        child.wait()
    thread.join(timeout=2.0)
    assert not thread.is_alive()  # the process is gone: the throttle ended


@pytest.mark.integration
def test_throttle_fires_once_at_its_step_on_the_target_rank(tmp_path):
    store = DictStore()
    injector = FaultInjector(store, "node0", parse_schedule("throttle@step=3:rank=1:factor=3", 2))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        injector.on_agent_tick({1: 2}, {1: child.pid}, {1: tmp_path / "log"})
        assert store.events() == []
        injector.on_agent_tick({1: 3}, {1: child.pid}, {1: tmp_path / "log"})
        assert [e["fault"] for e in store.events()] == ["throttle"]
        assert "runs 1/3 of each 100 ms" in store.events()[0]["message"]

        def status() -> str:
            return psutil.Process(child.pid).status()

        deadline = time.monotonic() + 2.0
        while status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.005)
        assert status() == psutil.STATUS_STOPPED
    finally:
        child.kill()
        child.wait()


@pytest.mark.integration
def test_a_throttle_period_sets_the_length_of_each_stop():
    """300/300 ms: the worker is stopped for stretches of about 0.3 s, not 0.05 s."""
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        throttle(child.pid, run_fraction=0.5, period_s=0.6)
        stretches, start = [], None
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            stopped = psutil.Process(child.pid).status() == psutil.STATUS_STOPPED
            if stopped and start is None:
                start = time.monotonic()
            elif not stopped and start is not None:
                stretches.append(time.monotonic() - start)
                start = None
            time.sleep(0.005)
        assert stretches and max(stretches) > 0.2, stretches
    finally:
        child.kill()
        child.wait()


@pytest.mark.integration
@pytest.mark.skipif(not cpu_quota.available(), reason="no writable cpu cgroup here")
def test_a_cgroup_quota_caps_the_worker_to_a_share_of_what_it_used_and_goes_with_it():
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        thread = cpu_quota.cap(child.pid, 4.0, f"transom-test-{child.pid}")
        group = wait_for(
            lambda: next(
                (g for g in cpu_quota.CGROUP_ROOT.rglob(f"transom-test-{child.pid}")), None
            ),
            10,
            "the worker's cgroup",
        )
        wait_for(lambda: str(child.pid) in (group / "cgroup.procs").read_text(), 10, "the move")
        # a quarter of what it used, one CPU at most (less on a loaded machine), and still running
        assert 0.0 < cpu_quota.cpu_use(child.pid, 1.0) < 0.3
    finally:
        child.kill()
        child.wait()
    thread.join(timeout=15)
    assert not thread.is_alive() and not group.exists()  # the worker gone, its cgroup too


@pytest.mark.integration
@pytest.mark.skipif(not cpu_quota.available(), reason="no writable cpu cgroup here")
def test_a_quotas_event_carries_the_time_it_took_hold_and_the_step_seen_before_it(tmp_path):
    """The quota measures the rank's CPU for USAGE_WINDOW_S before capping it: its `fault` event
    says when the cap took hold (detection is timed from there) and the step the agent saw last
    before that, and the agent ticks quickly until it holds."""
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    store = DictStore()
    injector = FaultInjector(store, "node0", parse_schedule("quota@step=3:rank=1:factor=2", 2))
    logs = {1: tmp_path / "log"}
    ticks: list[tuple[float, float, int]] = []  # (began, ended, step)

    def tick() -> list[dict]:
        step = 3 + len(ticks)
        began = time.time()
        injector.on_agent_tick({1: step}, {1: child.pid}, logs)
        ticks.append((began, time.time(), step))
        injector.write_held()
        return store.events()

    try:
        assert not tick() and injector.agent_faults_left()  # fired, measuring, not yet held
        (event,) = wait_for(tick, 15, "the quota's event")
    finally:
        child.kill()
        child.wait()
    held = event["time"]
    assert held >= ticks[0][0] + cpu_quota.USAGE_WINDOW_S and "capped to 1/2" in event["message"]
    # the newest step seen before the cap took hold: never one the rank reached after it
    assert max(s for _, end, s in ticks if end <= held) <= event["step"]
    assert event["step"] <= max(s for begin, _, s in ticks if begin <= held)
    assert not injector.agent_faults_left()


@pytest.mark.skipif(not cpu_quota.available(), reason="no writable cpu cgroup here")
def test_a_quota_that_cannot_be_played_says_so_in_its_event(tmp_path):
    store = DictStore()
    injector = FaultInjector(store, "node0", parse_schedule("quota@step=3:rank=1:factor=2", 2))
    injector.on_agent_tick({1: 3}, {1: 2**22 + 12345}, {1: tmp_path / "log"})  # no such process
    (event,) = wait_for(lambda: injector.write_held() or store.events(), 15, "the event")
    assert "not played: could not cap worker" in event["message"] and event["step"] == 3


def test_a_quota_that_cannot_be_applied_is_logged_not_raised(caplog):
    thread = cpu_quota.cap(2**22 + 12345, 2.0, "transom-test-none")  # no such process
    thread.join(timeout=5)
    assert "could not cap worker" in caplog.text


def test_a_specs_faults_are_typed_records_through_etcds_json():
    spec = JobSpec(script="s.py", job_id="j", faults=parse_schedule("nan@step=3:rank=1", 4))
    stored = json.loads(json.dumps(spec.to_dict()))
    assert stored["faults"][0]["type"] == "nan"
    (fault,) = JobSpec.from_dict(stored).faults
    assert isinstance(fault, Fault) and fault == spec.faults[0]
