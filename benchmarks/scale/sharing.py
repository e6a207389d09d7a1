"""What the simulated node agents of one process share, for benchmarks/scale/agents.py.

Hundreds of real NodeAgents in one process cannot each keep a watch stream, a renewal thread and
a pause-guard thread (the simulator would starve, keep-alives would come late and nodes flap),
so per process there is one of each, while etcd and the controller still see every node's own
requests:
  - `SharedPlanStream`: one watch stream on the plan (and the masters' addresses under its name),
    fanned out to each agent's real PlanFollower (`PlanFeed`, `SharedPlanFollower`);
  - `RenewalScheduler`: each node's own lease, renewed by its own LeaseKeeper every TTL/2 on its
    own connection, scheduled by one thread and sent by RENEWERS threads (`SharedLeaseKeeper`);
  - `GuardSweep`: each agent's real PauseGuard rule, applied every GUARD_TICK_S by one thread
    (`SharedPauseGuard`);
  - `TurnSweep`: each agent's real loop turn (`NodeAgent._turn`), run every TICK_S and at once
    when the plan stream delivers, by one of SWEEPERS threads instead of the agent's own.
agents.py's docstring says how each differs from a real agent. This module never starts
a process and never touches etcd but through the agents' own stores.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import queue
import threading
import time

from transom.common import keys  # noqa: E402
from transom.control.agent import TICK_S, NodeAgent  # noqa: E402
from transom.control.fence import GUARD_TICK_S, PauseGuard  # noqa: E402
from transom.control.lease_keeper import LeaseKeeper  # noqa: E402
from transom.control.plan_follow import PlanFollower  # noqa: E402
from transom.store import Store  # noqa: E402
from transom.store.etcd_client import REFRESHES_PER_TTL  # noqa: E402
from transom.store.watch import PrefixWatch, Update  # noqa: E402

RENEWERS = 16  # threads that send the process's lease renewals (each one node's request)
SWEEPERS = 8  # threads that run the turns of the process's agents (each a share of them)
RECONNECT_MIN_S = 1.0  # the shared plan stream is dropped and resumed at most this often
log = logging.getLogger("transom.agent")


class SharedPlanStream:
    """The process's one watch stream on the plan, fanned out to every simulated agent's
    follower (`PlanFeed`): each gets every update the moment the stream delivers it."""

    def __init__(self) -> None:
        self.watch: PrefixWatch | None = None
        self.lock = threading.Lock()
        self.feeds: set[PlanFeed] = set()
        self.value: object | None = None  # the newest plan the stream delivered
        self.revision = 0
        self._reconnected_at = -math.inf
        self._stopping = threading.Event()

    @property
    def healthy(self) -> bool:
        return self.watch is not None and self.watch.healthy

    def start(self, store: Store) -> None:
        """Read the plan and follow it (before any agent subscribes)."""
        self.watch = PrefixWatch(store, keys.PLAN)
        values, self.revision = self.watch.read()
        self.value = values.get("")
        self.watch.follow(self.revision)
        threading.Thread(target=self._run, name="plan-fanout", daemon=True).start()

    def stop(self) -> None:
        self._stopping.set()
        if self.watch is not None:
            self.watch.stop()

    def subscribe(self, feed: PlanFeed, revision: int) -> None:
        """Deliver to `feed` every update after `revision` (the newest plan at once, if the
        stream delivered one after `revision` before `feed` subscribed)."""
        with self.lock:
            self.feeds.add(feed)
            if self.revision > revision:
                feed.updates.put(Update(revision=self.revision, snapshot={"": self.value}))

    def unsubscribe(self, feed: PlanFeed) -> None:
        with self.lock:
            self.feeds.discard(feed)

    def reconnect(self) -> None:
        """An agent's resync: drop the stream and resume it (at most every RECONNECT_MIN_S)."""
        with self.lock:
            now = time.monotonic()
            if now - self._reconnected_at < RECONNECT_MIN_S:
                return
            self._reconnected_at = now
        if self.watch is not None:
            self.watch.reconnect()

    def _run(self) -> None:
        assert self.watch is not None
        while not self._stopping.is_set():
            update = self.watch.get(timeout=0.5)
            if update is None:
                continue
            with self.lock:
                if update.snapshot is not None:
                    self.value = update.snapshot.get("")
                for event in update.events:
                    if event.name == "":
                        self.value = None if event.deleted else event.value
                self.revision = update.revision
                for feed in self.feeds:
                    feed.updates.put(update)
            TURNS.wake()  # every agent takes the update in at its next turn, now


STREAM = SharedPlanStream()


class PlanFeed(PrefixWatch):
    """One agent's end of the shared plan stream, with PrefixWatch's interface. Its direct
    reads (`read`: the first, fallbacks while the stream is down, resyncs) are the agent's
    own, one range request each, as a real agent's."""

    def __init__(self, store: Store, name: str) -> None:
        super().__init__(store, name)
        self.updates = queue.Queue()  # unbounded: the shared stream never waits for an agent

    @property  # type: ignore[override]
    def healthy(self) -> bool:
        return STREAM.healthy

    @healthy.setter
    def healthy(self, value: bool) -> None:
        pass  # the shared stream's

    def follow(self, revision: int) -> None:
        self.revision = revision
        STREAM.subscribe(self, revision)

    def reconnect(self) -> None:
        STREAM.reconnect()

    def stop(self) -> None:
        STREAM.unsubscribe(self)


class SharedPlanFollower(PlanFollower):
    """The real PlanFollower, fed by the process's shared plan stream."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.watch = PlanFeed(store, keys.PLAN)


class RenewalScheduler:
    """Renews every simulated node's own lease, each `interval_s` after its previous renewal
    ended (as a LeaseKeeper's own thread does): one thread keeps the schedule, RENEWERS
    threads send the requests (one keep-alive per node per period, on the node's own
    connection)."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, SharedLeaseKeeper]] = []
        self.cond = threading.Condition()
        self.due: queue.Queue[SharedLeaseKeeper] = queue.Queue()
        self.count = 0
        self.late_s = 0.0  # the most a renewal was sent after its time, since main reset it

    def start(self) -> None:
        threading.Thread(target=self._schedule, name="renewals", daemon=True).start()
        for i in range(RENEWERS):
            threading.Thread(target=self._renew, name=f"renewer-{i}", daemon=True).start()

    def add(self, keeper: SharedLeaseKeeper, at: float) -> None:
        with self.cond:
            self.count += 1
            heapq.heappush(self.heap, (at, self.count, keeper))
            self.cond.notify()

    def _schedule(self) -> None:
        while True:
            with self.cond:
                if not self.heap:
                    self.cond.wait()
                    continue
                at, _, keeper = self.heap[0]
                wait = at - time.monotonic()
                if wait > 0:
                    self.cond.wait(wait)
                    continue
                heapq.heappop(self.heap)
            keeper.due_at = at
            self.due.put(keeper)

    def _renew(self) -> None:
        while True:
            keeper = self.due.get()
            if keeper.stopping.is_set():
                continue
            self.late_s = max(self.late_s, time.monotonic() - keeper.due_at)
            try:
                keeper.renew()
            except Exception:  # the real keeper's thread would end; this one serves others
                log.exception("lease renewal of %s", keeper.store.job_id)
            self.add(keeper, time.monotonic() + keeper.interval_s)


RENEWALS = RenewalScheduler()


class SharedLeaseKeeper(LeaseKeeper):
    """The real LeaseKeeper (its renewal, its evidence of contact), renewed by the process's
    RenewalScheduler instead of a thread of its own."""

    due_at = 0.0

    def start(self, ttl_s: float) -> None:
        self.interval_s = ttl_s / REFRESHES_PER_TTL
        RENEWALS.add(self, time.monotonic() + self.interval_s)


class GuardSweep:
    """Every GUARD_TICK_S, applies each simulated agent's PauseGuard (the real rule), from one
    thread instead of one a node."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.guards: list[SharedPauseGuard] = []

    def start(self) -> None:
        threading.Thread(target=self._run, name="pause-guards", daemon=True).start()

    def add(self, guard: SharedPauseGuard) -> None:
        with self.lock:
            self.guards.append(guard)

    def _run(self) -> None:
        while True:
            time.sleep(GUARD_TICK_S)
            with self.lock:
                self.guards = [g for g in self.guards if not g.stopping.is_set()]
                guards = list(self.guards)
            for guard in guards:
                reason = guard.due()
                if reason is not None:
                    try:
                        guard.pause(reason)
                    except Exception:  # as the real guard: outlive any one failure
                        log.exception("cannot pause the workers")


GUARDS = GuardSweep()


class SharedPauseGuard(PauseGuard):
    def start(self) -> None:
        GUARDS.add(self)


class TurnSweep:
    """Runs each simulated agent's loop turns, as its own loop would (a turn, then until
    TICK_S later or a plan update arrives), from SWEEPERS threads instead of one per agent:
    hundreds of threads each waking five times a second would cost the simulator more than
    the turns themselves. An agent's turns are all run by the same thread, one after another.
    (A real agent whose workers train steadily turns every STEADY_TICK_S; here every TICK_S.)"""

    def __init__(self) -> None:
        self.sweepers = [_Sweeper(i) for i in range(SWEEPERS)]
        self.joined = itertools.count()  # agents' threads join at once: next() is atomic

    def start(self) -> None:
        for sweeper in self.sweepers:
            threading.Thread(target=sweeper.run, name=f"turns-{sweeper.index}", daemon=True).start()

    def serve(self, agent: NodeAgent, dead: threading.Event) -> int | None:
        """Run `agent`'s turns until one returns an outcome (returned) or raises (raised), it
        stops (0) or `dead` is set (None); the calling thread (the agent's own) waits."""
        turns = _Turns(agent, dead)
        self.sweepers[next(self.joined) % SWEEPERS].add(turns)
        turns.done.wait()
        if turns.error is not None:
            raise turns.error
        return turns.outcome

    def wake(self) -> None:
        for sweeper in self.sweepers:
            sweeper.wake.set()


class _Turns:
    """One agent's place in a sweeper, and how its loop ended."""

    def __init__(self, agent: NodeAgent, dead: threading.Event) -> None:
        self.agent = agent
        self.dead = dead
        self.done = threading.Event()
        self.outcome: int | None = 0
        self.error: BaseException | None = None

    def turn(self) -> None:
        """One turn, or the end of the loop (`done` set)."""
        if self.dead.is_set():
            self.outcome = None
        elif self.agent.stopping.is_set():
            self.outcome = 0
        else:
            try:
                self.outcome = self.agent._turn()
            except BaseException as e:  # noqa: BLE001 - raised in the agent's own thread
                self.error = e
            if self.outcome is None and self.error is None:
                return  # the loop goes on
        self.done.set()


class _Sweeper:
    def __init__(self, index: int) -> None:
        self.index = index
        self.lock = threading.Lock()
        self.turns: list[_Turns] = []
        self.wake = threading.Event()

    def add(self, turns: _Turns) -> None:
        with self.lock:
            self.turns.append(turns)
        self.wake.set()

    def run(self) -> None:
        while True:
            self.wake.wait(TICK_S)
            self.wake.clear()
            with self.lock:
                turns = list(self.turns)
            for t in turns:
                t.turn()
            if any(t.done.is_set() for t in turns):
                with self.lock:
                    self.turns = [t for t in self.turns if not t.done.is_set()]


TURNS = TurnSweep()
