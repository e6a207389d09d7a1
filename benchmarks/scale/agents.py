"""Many simulated node agents in one process, for benchmarks/scale/scale_bench.py.

Each simulated node is a real `transom.control.agent.NodeAgent` (its registration under a lease,
lease keep-alive, the plan followed through etcd, generation following, status and monitor
publishing only on change or at their heartbeats, outage handling: the agent's whole control
logic, unchanged) whose loop runs in a thread of its own, with the parts that touch the machine
replaced by stand-ins:
  - workers: `StandInGroup` starts no process; its ranks "train" one step every STEP_S from the
    moment the group starts, and never fail;
  - monitor: `StandInMonitor` reports those steps (a summary per SUMMARY_PERIOD_S, as the real
    one) without a socket, log scanning or GPU reads;
  - checkpoint server, pre-flight checks (the node's own and its link tests to peers, with their
    link-test port) and the generation's torch store: do nothing, and pass (so the etcd traffic
    of real checkpoint servers, catalog entries included, and of link tests is not in the
    numbers).
What a real agent has alone, the simulated agents of one process share where etcd and the
controller still see the same per node (benchmarks/scale/sharing.py; injected into
transom.control.agent like the stand-ins; transom/control is unchanged):
  - the plan watch: one watch stream per process (`SharedPlanStream`) instead of one per node;
    each agent's real PlanFollower gets every update the moment the stream delivers it (a queue
    put per agent). What differs: etcd serves one watcher per process, not one per node (fewer
    streams, connections and event copies); when that stream is down, every agent of the
    process sees it down at once (each then reads the plan itself, as a real one does); a
    resync (after an outage or a lost lease) drops and resumes the shared stream, at most once
    per RECONNECT_MIN_S for the process. The agent's direct reads (the first, fallbacks,
    resyncs) are its own, one range request each, on its own connection, as a real agent's;
  - lease renewals: each node's own lease, renewed by its own LeaseKeeper (`renew`: one
    keep-alive request per node every TTL/2, after the previous one ended, on the node's own
    connection; the same evidence of contact and lease loss for its agent), but scheduled by one
    thread per process (`RenewalScheduler`) and sent by RENEWERS threads instead of a thread
    per node. What differs: when many are due at once a renewal waits for a free sender
    (the most any waited is printed, scale.py reports it as renewal_late_max_s), and a renewal
    that hangs on a dead etcd holds one of the senders, not only its own node's thread;
  - the pause guard: each agent's real PauseGuard rule, applied every GUARD_TICK_S by one
    thread per process (`GuardSweep`) instead of a thread per node;
  - the loop: each agent starts (`NodeAgent._join`) in its own thread, then its turns
    (`NodeAgent._turn`, every TICK_S and at once when a plan update arrives) are run by one of
    SWEEPERS threads per process (`TurnSweep`) instead of its own. What differs: a turn that
    waits on etcd (a slow answer, an outage) delays the turns of its sweeper's other agents.
Real agents also differ in running one per machine, each with its own CPU; here hundreds share a
process and its interpreter lock, so an agent's tick, a renewal or a status can run late when
the process is busy (each process reports its agents' achieved ticks per second). Each agent
keeps its own etcd client (connections, TLS), so every request etcd sees is one node's own.

Lines it prints (flushed, each in one write), for scale.py:
    ready N                 every agent thread is started
    acted NODE GEN T        NODE followed the plan of generation GEN at time T (time.time())
    started NODE GEN T      NODE started its workers of generation GEN (the master address
                            known) at time T
    dead NODE T             NODE stopped acting (told through its kill file)
    ticks N T LATE          N agent loop turns were done in total by time T (every second);
                            LATE: the most a lease renewal was sent after its time since
                            the last such line, seconds
    failed NODE ERROR       NODE's agent raised (a bug); the process then exits with 1
It stops on SIGTERM. A node dies (stops ticking, keeps its lease renewed until someone revokes
it) when the file KILL_DIR/NODE appears. This module never touches processes other than its own.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

from benchmarks.scale.sharing import (  # noqa: E402
    GUARDS,
    RENEWALS,
    STREAM,
    TURNS,
    SharedLeaseKeeper,
    SharedPauseGuard,
    SharedPlanFollower,
)
from transom.common.records import MonitorSummary, PreflightResult, RankSummary  # noqa: E402
from transom.common.states import NodeState  # noqa: E402
from transom.control import agent as agent_module  # noqa: E402
from transom.monitor.summary_pace import (  # noqa: E402
    ATTENTIVE_S,
    SUMMARY_MIN_PERIOD_S,
    SUMMARY_PERIOD_S,
    SUMMARY_STEPS,
)
from transom.store import Store, StoreAccess  # noqa: E402

STEP_S = 0.5  # one stand-in training step
KILL_POLL_S = 0.05
_print_lock = threading.Lock()
log = logging.getLogger("transom.agent")


def say(line: str) -> None:
    """One line to stdout, in one write (scale.py parses them; logs go to stderr)."""
    with _print_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class StandInProcess:
    """A worker process that never exits."""

    def poll(self) -> int | None:
        return None


class StandInGroup:
    """A node's workers, without processes: `nproc_per_node` ranks that make steps."""

    def __init__(self, assignment, script, script_args, log_dir, extra_env):
        self.assignment = assignment
        self.started = time.monotonic()
        self.processes = [StandInProcess() for _ in range(assignment.nproc_per_node)]
        self.log_paths = [Path(log_dir) / f"rank{i}.log" for i in range(len(self.processes))]
        self.pids: dict[int, int] = {}
        self.paused_at: float | None = None
        self.started_as = ["stand-in"] * assignment.nproc_per_node  # the agent logs it

    def pause(self, now: float) -> bool:
        if self.paused_at is not None:
            return False
        self.paused_at = now
        return True

    def resume(self) -> None:
        self.paused_at = None

    def start(self, warm, on_exit=None) -> None:
        """No processes: nothing exits, so `on_exit` is never called."""
        self.started = time.monotonic()

    def step(self) -> int:
        return int((time.monotonic() - self.started) / STEP_S)

    def poll(self):
        return NodeState.RUNNING.value, []

    def stop(self) -> None:
        pass


class StandInMonitor:
    """The node monitor's interface, fed by the stand-in group's steps."""

    def __init__(
        self,
        node_id: str,
        scope: str = "",
        hang_floor_s: float = float("inf"),
        script: str = "",
        nvml=None,
        wake=None,
    ) -> None:  # NodeMonitor's parameters, as the agent passes them (no datagram wakes it)
        self.node_id = node_id
        self.socket_path = Path("/nonexistent")
        self.generation = 0
        self.ranks: dict[int, object] = {}  # the real one's rank tracks (none: nothing to fence)
        self.expected: list[int] = []
        self.group: StandInGroup | None = None
        self._published_at = 0.0
        self._published_step: int | None = None
        self._attentive_until = -float("inf")
        self.answers = ""  # the newest summary request answered

    def new_generation(self, generation: int) -> None:
        self.generation, self.expected = generation, []
        self._attentive_until = time.monotonic() + ATTENTIVE_S

    def expect_ranks(self, ranks: list[int], stacks_dir: Path | None = None) -> None:
        self.expected = list(ranks)

    def steps(self) -> dict[int, int | None]:
        step = self.group.step() if self.group is not None and self.expected else None
        return dict.fromkeys(self.expected, step)

    def newest_step(self) -> int | None:
        return max((s for s in self.steps().values() if s is not None), default=None)

    def raise_anomaly(self, anomaly) -> None:
        pass

    def excuse(self, seconds: float) -> None:
        pass  # its ranks' steps come from the clock, not from reports a pause could delay

    def take_fired_faults(self) -> list:
        return []

    def check(self, pids, logs) -> None:
        pass

    def due(self, now: float) -> bool:
        return now - self._published_at >= SUMMARY_PERIOD_S or self.steps_due(now)

    def answer(self, asked) -> bool:
        """As the real monitor: the controller's newest summary request, once (this
        generation's); the next summary names it."""
        if asked is None or asked.generation != self.generation or asked.id == self.answers:
            return False
        self.answers = asked.id
        return True

    def steps_due(self, now: float) -> bool:
        """As the real monitor: SUMMARY_STEPS new steps since the last summary, while attentive
        (its steps' timings never shift: for ATTENTIVE_S after a generation's start)."""
        if now >= self._attentive_until or now - self._published_at < SUMMARY_MIN_PERIOD_S:
            return False
        newest = self.newest_step()
        return newest is not None and newest >= (self._published_step or 0) + SUMMARY_STEPS

    def collect(self):
        self._published_at = time.monotonic()
        self._published_step = self.newest_step()
        ranks = {
            str(rank): RankSummary(
                step=step,
                phase="step",
                step_age=0.1,
                beat_age=0.1,
                step_s=STEP_S,
                compute_s=STEP_S * 0.8,
            )
            for rank, step in self.steps().items()
        }
        summary = MonitorSummary(self.node_id, self.generation, time.time(), ranks=ranks)
        summary.answers = self.answers
        return summary, []

    def close(self) -> None:
        pass


class StandInCheckpointServer:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def launch(self) -> None:
        pass

    def start_patiently(self, stopping=None) -> None:
        pass

    def use_lease(self, lease_id: int) -> None:
        pass

    def ensure_running(self) -> None:
        pass

    def worker_env(self) -> dict[str, str]:
        return {}

    def stop(self) -> None:
        pass


class StandInTorchStore:
    def __init__(self, host: str) -> None:
        self.port = 1
        self.proc = None

    def start(self, pool, log_path) -> None:
        self.proc = SimpleNamespace(pid=0)

    def close(self) -> None:
        pass


class StandInLinkServer:
    def __init__(self, host: str, delay_s: float = 0.0) -> None:
        pass

    def close(self) -> None:
        pass


def no_preflight(store, node_id, lease, link_server, spec, run_dir, faults):
    return PreflightResult(passed=True, compute_gflops=1.0)


agent_module.WorkerGroup = StandInGroup  # type: ignore[misc,assignment]
agent_module.NodeMonitor = StandInMonitor  # type: ignore[misc,assignment]
agent_module.NodeCheckpointServer = StandInCheckpointServer  # type: ignore[misc,assignment]
agent_module.TorchStore = StandInTorchStore  # type: ignore[misc,assignment]
agent_module.joining_checks = no_preflight  # type: ignore[assignment]
agent_module.links = SimpleNamespace(LinkServer=StandInLinkServer)  # type: ignore[assignment]
agent_module.PlanFollower = SharedPlanFollower  # type: ignore[misc]
agent_module.LeaseKeeper = SharedLeaseKeeper  # type: ignore[misc]
agent_module.PauseGuard = SharedPauseGuard  # type: ignore[misc]

TICKS = [0]
FAILED: list[str] = []  # nodes whose agent raised (the process then stops)


class SimulatedAgent(agent_module.NodeAgent):
    """The real agent; it reports when it acts on a plan, and it can die."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dead = threading.Event()

    def _follow(self, plan) -> None:
        super()._follow(plan)
        say(f"acted {self.node_id} {plan.generation} {time.time():.6f}")

    def _start_group(self, plan) -> None:
        super()._start_group(plan)
        if self.group is not None:
            self.monitor.group = self.group  # type: ignore[attr-defined]
            say(f"started {self.node_id} {plan.generation} {time.time():.6f}")

    def _serve(self) -> int:
        self._join()  # in the agent's own thread, as a real agent's; its turns: TURNS'
        outcome = TURNS.serve(self, self.dead)
        if outcome is None:  # a dead node: nothing more from it, its lease left to expire
            self.stopping.wait()
            return 0
        return outcome

    def _turn(self):
        TICKS[0] += 1
        return super()._turn()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--store", required=True)
    parser.add_argument("--store-ca", required=True)
    parser.add_argument("--store-cert", required=True)
    parser.add_argument("--store-key", required=True)
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--kill-dir", required=True, type=Path)
    parser.add_argument("nodes", nargs="+")
    args = parser.parse_args()
    access = StoreAccess(
        args.store, Path(args.store_ca), Path(args.store_cert), Path(args.store_key)
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    STREAM.start(Store(access, args.job_id))
    RENEWALS.start()
    GUARDS.start()
    TURNS.start()
    agents = {n: SimulatedAgent(Store(access, args.job_id), n, args.run_dir) for n in args.nodes}
    for node, agent in agents.items():
        threading.Thread(
            target=run_agent, args=(agent, stop), name=f"agent-{node}", daemon=True
        ).start()
    say(f"ready {len(agents)}")
    last = time.monotonic()
    parent = os.getppid()
    while not stop.wait(KILL_POLL_S):
        if os.getppid() != parent:  # scale.py is gone: stop too
            break
        for node in os.listdir(args.kill_dir):  # one directory read, not a stat per agent
            agent = agents.get(node)
            if agent is not None and not agent.dead.is_set():
                agent.dead.set()
                say(f"dead {node} {time.time():.6f}")
        if time.monotonic() - last >= 1.0:
            last = time.monotonic()
            late, RENEWALS.late_s = RENEWALS.late_s, 0.0
            say(f"ticks {TICKS[0]} {time.time():.6f} {late:.3f}")
    for agent in agents.values():
        agent.stopping.set()
    STREAM.stop()
    return 1 if FAILED else 0


def run_agent(agent: SimulatedAgent, stop: threading.Event) -> None:
    """`agent.run()`; an agent that raises (a stand-in out of step with the agent it serves)
    says so and stops the process, so scale.py fails at once instead of waiting out its
    timeout for nodes that will never register."""
    try:
        agent.run()
    except BaseException as e:
        FAILED.append(agent.node_id)
        traceback.print_exc()
        say(f"failed {agent.node_id} {type(e).__name__}: {e}")
        stop.set()


if __name__ == "__main__":
    sys.exit(main())
