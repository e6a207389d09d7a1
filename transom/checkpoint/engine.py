"""The worker's checkpoint API: `Engine.save` blocks only for a memory copy, `Engine.load` takes
the fastest tier that holds a good copy.

    ckpt = checkpoint.Engine()                       # from the launcher's environment, or arguments
    h = ckpt.save(step, {"model": ..., "optim": ..., "rng": ..., "data": ...})
    h.wait("peer"); h.wait("storage")                # only when the caller wants to
    ckpt.save(step, state, persist=False)            # memory and peer only (storage less often)
    state = ckpt.load()                              # the newest step all ranks hold, or the plan's

Resharding (reshard.py) drives a load through three more public calls, its `ShardReader`:
`read_shard` (one saved rank's shard, as saved), `locate` (where the server knows copies of one)
and `report_event` (an event in the job's log).

Under `transom run` the engine talks to its node's checkpoint server (TRANSOM_CKPT_SOCKET) and
loads the step the controller chose (TRANSOM_RESTORE_STEP). Without a launcher it starts a server
inside this process (its threads persist to `storage_dir` in the background): memory and storage
tiers, no peer replica, and `close()` waits for pending writes so the next process finds them.

Tiers are named by `Tier` (memory, peer, storage); the load path walks `tiers.REGISTERED`.
A save (planned by flatten.py) copies every tensor straight into a shared-memory region the
server hands out (CUDA: asynchronously into that region registered as pinned memory, committed
from a thread once the copy has finished; CPU: committed by a request whose reply is read with
the next one, client.py's `send`, or with `overlap` copied on a thread while training goes on,
overlap.py). A load from local memory maps the server's region copy-on-write (shm.py). Every
load path verifies the shard's checksums; a bad copy is reported and the next tier tried.

Every request to the server has a time limit (client.py; `locate` LOCATE_TIMEOUT_S), so a
stuck or silent server never stops training: a save whose request times out is a refused save
(the handle says why, `wait` raises SaveRefused, a `refused` event is sent in the background), and
a load whose `locate` times out reads the tiers it can reach itself (storage).
This module never pickles or unpickles.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from transom.checkpoint import (
    agreement,
    flatten,
    layout,
    reshard,
    tiers,
)
from transom.checkpoint import worker_protocol as wire
from transom.checkpoint.bad_copy import BAD_COPY, BadCopy
from transom.checkpoint.client import (
    REQUEST_TIMEOUT_S,
    CheckpointError,
    RequestTimeout,
    ServerConnection,
)
from transom.checkpoint.header_tables import WorkerTables
from transom.checkpoint.load_record import LoadRecord
from transom.checkpoint.next_region import NextRegion, ReservedAhead
from transom.checkpoint.overlap import CopyInFlight
from transom.checkpoint.pinning import PinnedRegions
from transom.checkpoint.save_handle import SaveHandle
from transom.checkpoint.shard_format import Timeline
from transom.checkpoint.shm import MappingCache
from transom.checkpoint.single_file import to_device
from transom.checkpoint.tiers import LoaderContext
from transom.common import env, files

if TYPE_CHECKING:
    from transom.checkpoint.server import CheckpointServer

log = logging.getLogger("transom.ckpt")

DEFAULT_STORAGE = files.CHECKPOINTS
# `locate` may wait for checksums being computed (worker_service.STAGED_WAIT_S): a longer limit.
LOCATE_TIMEOUT_S = 60.0
LOCAL_JOB = "local"  # the job id of shards saved without a launcher


class Engine:
    def __init__(
        self,
        socket_path: str | None = None,
        storage_dir: str | os.PathLike[str] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        memory_bytes: int | None = None,
        keep: int | None = None,
        secret: bytes | None = None,
        request_timeout_s: float | None = None,
    ):
        self.request_timeout_s = (
            REQUEST_TIMEOUT_S if request_timeout_s is None else float(request_timeout_s)
        )
        self.locate_timeout_s = max(LOCATE_TIMEOUT_S, self.request_timeout_s)  # tests may lower it
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.world_size = (
            int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
        )
        storage_env = os.environ.get(env.CHECKPOINT_DIR)
        self.storage_dir = Path(storage_dir or storage_env or DEFAULT_STORAGE).absolute()
        self.secret = secret if secret is not None else os.environ.get(env.CKPT_SECRET, "").encode()
        # The timeline every shard is saved under (job, generation, world size: `Timeline`).
        self.job_id = os.environ.get(env.JOB_ID) or LOCAL_JOB
        # Under a launcher: this worker's generation (the plan decides what `load` restores).
        launched = os.environ.get(env.GENERATION)
        self.generation: int | None = int(launched) if launched else None
        self._finalizer: Any = None  # frees an embedded server's regions at exit
        given_socket = socket_path or os.environ.get(env.CKPT_SOCKET)
        self.server: CheckpointServer | None = None  # the embedded one, without a launcher
        if given_socket:
            self.socket_path = given_socket
        else:
            self.server = server = self._embedded_server(memory_bytes, keep)
            self.socket_path = str(server.cfg.socket_path)
        self.connection = ServerConnection(self.socket_path, self.request_timeout_s)
        self._pinned = PinnedRegions()
        self._copy = CopyInFlight()
        self._maps = MappingCache(layout.as_bytes, release=self._pinned.release)
        self._next = NextRegion(self.connection, self._maps, self.rank)
        self._ahead = ReservedAhead(self.connection, self.rank)
        self._tables = WorkerTables()
        self._pending: list[threading.Thread] = []
        self.last_load: LoadRecord | None = None  # what the last successful load read
        self.last_shard = reshard.ShardRead()  # the world size and resharding record read

    def _embedded_server(self, memory_bytes: int | None, keep: int | None) -> CheckpointServer:
        from transom.checkpoint import in_process  # imports the server: only when one starts

        server = in_process.start_server(self.storage_dir, self.job_id, memory_bytes, keep)
        # Freed when this process exits normally even if `close` is never called (a SIGKILLed
        # process's folder is swept by the next engine or node agent on this machine).
        self._finalizer = weakref.finalize(self, server.stop)
        return server

    def timeline(self) -> Timeline:
        """The timeline this engine's shards are saved under."""
        return Timeline(str(self.job_id), self.generation or 0, self.world_size)

    # -- save ------------------------------------------------------------------------------------
    def prepare(self, state: Any, persist: bool = True) -> bool:
        """Have the server populate regions for saves of `state`'s size ahead of time (one for
        each save of a rotation of saves with this `persist`: the steps memory keeps and the save
        in progress), so even the first saves are plain memory copies. False when the budget
        has no room for a spare region."""
        plan = reshard.plan_state(state, 0, self.rank, self.world_size)
        try:
            reply = self.connection.request(wire.Prepare(plan.data_len, self.rank, persist))
        except RequestTimeout as e:
            log.warning("%s: no region prepared", e)
            return False
        if isinstance(reply, wire.Region) and reply.path and plan.data_len:
            data = self._maps.get(reply.path, plan.data_len)  # map it now, not during the save
            if plan.cuda_devices():
                self._pinned.pin(data)  # and register it now, not during the save
        return isinstance(reply, wire.Region)

    def save(
        self,
        step: int,
        state: Any,
        replicated: Iterable[str] = (),
        persist: bool = True,
        overlap: bool = False,
    ) -> SaveHandle:
        """Copy `state` into the node's checkpoint memory and return; the rest happens in the
        background. `replicated` names the values the same on every rank ("model", "optim/state",
        "" for all), so a world of another size can load this step (reshard.py). Not `persist`:
        memory and peer only, storage only if it is still the newest when its server stops or
        an embedded one closes (every rank must pass the same for a step: storage keeps steps
        all ranks wrote). `overlap` (CPU tensors): the bytes are copied on a thread while
        training goes on, and the next optimizer step waits for that copy (overlap.py: nothing
        else may change the state's tensors meanwhile).

        A save the server refuses (memory budget), does not answer in time or cannot take (it
        died; the agent starts a new one) does not raise: the handle says why, `wait` raises
        SaveRefused, a warning is logged (a timeout or a lost region is also reported as a
        `refused` event). Training goes on; the next save reaches the new server."""
        t0 = time.perf_counter()
        self.settle()  # an overlapped save before it done, its replies read: in step order
        plan = reshard.plan_state(
            state, step, self.rank, self.world_size, replicated, self.timeline()
        )
        reserve = wire.Reserve(step, self.rank, plan.data_len, self.world_size, self.generation)
        try:
            reply = self._ahead.take(reserve) or self.connection.request(reserve)
        except RequestTimeout as e:
            return self._refused(step, str(e), report=True)
        except CheckpointError as e:  # the server is gone: a restart would cost more than a save
            return self._refused(step, str(e))
        if isinstance(reply, wire.Failed):
            if not reply.refused:
                raise CheckpointError(f"save of step {step} failed: {reply.error}")
            return self._refused(step, reply.error)
        self._maps.drop_missing()  # unmap what the server deleted: its memory goes back
        try:
            data = self._maps.get(reply.path, reply.nbytes)
        except OSError as e:  # reserved ahead from a server that died since
            self._abort(step)
            return self._refused(step, f"the region for step {step} is gone ({e})", report=True)
        handle = SaveHandle(self, step, self.rank)
        devices = plan.cuda_devices()
        if overlap and not devices:
            self._copy.start(
                functools.partial(flatten.copy_into, plan, data),
                functools.partial(self._copied, handle, plan, persist, reserve),
            )
            handle.blocking_s = time.perf_counter() - t0
            self._next.after(plan.data_len, step)
            return handle
        try:
            if devices:
                self._pinned.pin(data)
            flatten.copy_into(plan, data, non_blocking=bool(devices))
        except BaseException:
            self._abort(step)
            raise
        if devices:
            # A device-to-host copy runs on its source device's current stream (not always the
            # current device's: a model moved to cuda:1 without set_device); later kernels on
            # those streams are ordered after it, so training may go on.
            done = [torch.cuda.current_stream(d).record_event() for d in devices]
            self._pinned.copying(data, done)
            args = (handle, plan, persist, done)
            thread = threading.Thread(target=self._commit_after, args=args, daemon=True)
            self._pending = [t for t in self._pending if t.is_alive()] + [thread]
            thread.start()
        else:
            self._commit(handle, plan, persist, wait=False)
        handle.blocking_s = time.perf_counter() - t0
        if handle.ok:
            self._next.after(plan.data_len, step)
        return handle

    def _refused(self, step: int, error: str, report: bool = False) -> SaveHandle:
        """The handle of a save that did not happen; `report` sends a `refused` event."""
        log.warning("checkpoint of step %d refused: %s", step, error)
        if report:
            self._report_later(
                "refused",
                f"rank {self.rank} step {step}: save refused: {error}",
                step=step,
                rank=self.rank,
                error=error,
            )
        return SaveHandle(self, step, self.rank, error=error)

    def _commit(
        self, handle: SaveHandle, plan: flatten.Plan, persist: bool, wait: bool = True
    ) -> None:
        """Tell the server the copy of `handle`'s shard is done (its header's tables once per
        connection: header_tables.py). Without `wait` only the request is written: its reply
        comes with the connection's next request (or `settle`, which `handle.wait` calls)."""
        request = wire.Commit(handle.step, self.rank, plan.header.to_json(), persist, plan.tables)
        answered = functools.partial(self._commit_answered, handle)
        if not wait:
            self._tables.send(self.connection, request, answered)
            return
        try:
            reply: wire.Done | wire.Failed | CheckpointError = self._tables.commit(
                self.connection, request
            )
        except CheckpointError as e:
            reply = e
        answered(reply)

    def settle(self, timeout: float | None = None) -> None:
        """Once the copy in flight has sent its commit, read the replies of the commits sent
        without waiting, and send in full those whose server lacked their tables (within
        `timeout` s, as far as the copy and the replies go)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._copy.wait_finished(timeout)
        self.connection.settle(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._tables.resend(self.connection)

    def _commit_answered(
        self, handle: SaveHandle, reply: wire.Done | wire.Failed | CheckpointError
    ) -> None:
        try:
            if isinstance(reply, CheckpointError):
                handle.error = str(reply)
                if isinstance(reply, RequestTimeout):
                    self._refused(handle.step, handle.error, report=True)
            elif isinstance(reply, wire.Failed):
                handle.error = reply.error
        finally:
            handle._committed.set()

    def _commit_after(
        self, handle: SaveHandle, plan: flatten.Plan, persist: bool, done: list[torch.cuda.Event]
    ) -> None:
        try:
            for event in done:
                event.synchronize()
        except RuntimeError as e:  # the device failed: the region may hold part of the shard
            self._abort(handle.step)
            error = CheckpointError(f"step {handle.step}: the copy from the GPU failed: {e}")
            self._commit_answered(handle, error)  # `wait` raises it, never waits for ever
            return
        self._commit(handle, plan, persist)

    def _copied(
        self,
        handle: SaveHandle,
        plan: flatten.Plan,
        persist: bool,
        reserved: wire.Reserve,
        error: BaseException | None,
    ) -> None:
        """An overlapped copy ended (overlap.py): commit it, or give its region back; then
        reserve the next step's region if saves come every step (next_region.py)."""
        if error is not None:
            self._abort(handle.step)
            failed = CheckpointError(f"step {handle.step}: the copy failed: {error!r}")
            return self._commit_answered(handle, failed)  # `wait` raises it
        self._commit(handle, plan, persist, wait=False)  # its reply is read by the next save
        if handle.ok:
            self._ahead.after(handle.step, reserved.nbytes, reserved.world_size, self.generation)

    def _abort(self, step: int) -> None:
        """Give back the region reserved for `step`, whose copy did not finish."""
        try:
            self.connection.request(wire.Abort(step, self.rank))
        except CheckpointError:
            pass  # the connection is closed: the server gives the region back itself

    # -- load ------------------------------------------------------------------------------------
    def restore_step(self) -> int | None:
        """The step the controller chose for this generation (TRANSOM_RESTORE_STEP), if any."""
        return _env_step(env.RESTORE_STEP)

    def newer_held(self, floor: int) -> list[int]:
        """Steps of this rank's shard saved by this world in [floor, TRANSOM_RESTORE_BEFORE) that
        its node's server or a peer holds in memory, newest first, then `floor` (alone when the
        server does not answer): the catalog lists a save up to a second late."""
        request = wire.Held(self.rank, self.world_size, floor, _env_step(env.RESTORE_BEFORE))
        try:
            reply = self.connection.request(request, timeout=self.locate_timeout_s)
        except CheckpointError as e:
            log.warning("%s; restoring step %d", e, floor)
            return [floor]
        held = reply.steps if isinstance(reply, wire.StepList) else []
        return [*sorted({s for s in held if s > floor}, reverse=True), floor]

    def steps(self) -> list[int]:
        """Steps restorable for every rank of this world, newest first."""
        try:
            reply = self.connection.request(wire.Steps(self.world_size))
            return reply.steps if isinstance(reply, wire.StepList) else []
        except CheckpointError as e:
            log.warning("%s; looking in the tiers the loader reads itself", e)
            ctx = LoaderContext(self.storage_dir, self.secret)
            found = {s for tier in tiers.REGISTERED for s in tier.steps(ctx, self.world_size)}
            return sorted(found, reverse=True)

    def restore_candidates(self, floor: int | None) -> list[int]:
        """The steps a restore tries in turn (agreement.agree): every step held, newest first;
        with the plan's step `floor`, the newer ones held, then it and older ones (it may have
        gone)."""
        held = self.steps()
        return held if floor is None else [*self.newer_held(floor), *(s for s in held if s < floor)]

    def load(
        self,
        step: int | None = None,
        map_location: str | torch.device | None = None,
        tier: str | None = None,
        rank: int | None = None,
    ) -> Any:
        """The state saved at `step` (default: under a launcher the newest step every rank
        holds at or after the plan's restore step and before its rollback bound, agreed over
        the process group - the plan's step itself without one; None when the plan names none,
        a fresh start, never the newest step, which may be poisoned; without a launcher the
        newest step every rank can load; the same on every rank: agreement.py), bit for bit;
        None when there is nothing to restore. Tensors
        are on the CPU unless `map_location` says otherwise; `tier` ("memory", "peer",
        "storage") reads only there; `rank` reads that rank's shard as saved. A step saved by a
        world of another size is resharded for this rank (reshard.py; `last_load.resharded`
        says what was left out)."""
        self._copy.wait_finished()  # a save being copied: its step may be the one loaded
        self._ahead.forget()
        floor = self.restore_step() if step is None else None
        if step is None and floor is None and self.generation is not None:
            log.info("the plan names no restore step: starting fresh")
            return None

        def load_step(s: int) -> Any:
            return reshard.load(self, s, tier) if rank is None else self.read_shard(s, tier, rank)

        if step is not None:
            state = load_step(step)
        elif floor is not None and (rank is not None or not agreement.spans(self.world_size)):
            state = load_step(floor)  # the plan's step: no group to agree on a newer one with
        else:  # the newest step every rank holds (at or after the plan's): agreement.py
            size = self.world_size if rank is None else 1  # one given rank's shard: no peers
            candidates = self.restore_candidates(floor)
            agreed = agreement.agree(candidates, load_step, size, self.storage_dir)
            if agreed is None:
                return None
            state = agreed[1]
        self._next.after(reshard.plan_state(state, 0, self.rank, self.world_size).data_len)
        return to_device(state, map_location) if map_location is not None else state

    def locate(self, step: int, rank: int, timeout: float | None = None) -> list[wire.Source]:
        """The copies of rank `rank`'s shard of `step` that the node's server knows of (its
        memory, peers' memory, storage: what the tiers read); CheckpointError when it does not
        answer within `timeout` (default: the connection's)."""
        reply = self.connection.request(wire.Locate(step, rank), timeout=timeout)
        return reply.sources if isinstance(reply, wire.Located) else []

    def read_shard(self, step: int, tier: str | None, rank: int) -> Any:
        """Rank `rank`'s shard of `step` as it was saved (no resharding): walk the registered
        tiers (fastest first) and every copy each locates, until one verifies; CheckpointError
        naming each bad copy when none does."""
        t0 = time.perf_counter()
        try:
            located = self.locate(step, rank, self.locate_timeout_s)
        except CheckpointError as e:
            log.warning("%s; reading the tiers the loader reaches itself", e)
            located = []
        ctx = LoaderContext(self.storage_dir, self.secret, located)

        def bad(copy: BadCopy) -> None:
            self.report_event(
                BAD_COPY,
                f"rank {rank} step {step}: bad copy in {copy.tier} ({copy.error}); "
                "trying the next tier",
                **copy.to_dict(),
            )

        name, header, state = tiers.first_good(ctx, step, rank, tier, layout.rebuild, bad)
        took = time.perf_counter() - t0
        self.last_load = LoadRecord(step, name, took)
        self.last_shard = reshard.load_info(header)
        self.report_event(
            "restored",
            f"rank {rank} restored step {step} from {name} in {took:.3f} s",
            step=step,
            rank=rank,
            tier=name,
            duration_s=took,
        )
        return state

    def report_event(self, action: str, message: str, **fields: Any) -> None:
        """Log `message` and send it to the node's server as a checkpoint event (`action`,
        `fields`) for the job's event log."""
        log.info("%s", message)
        self._send_event(action, message, fields)

    def _report_later(self, action: str, message: str, **fields: Any) -> None:
        """`report_event` without waiting, on a connection of its own: for a server that may not be
        answering (the event is lost if it does not take it within request_timeout_s)."""
        args = (action, message, fields, True)
        threading.Thread(target=self._send_event, args=args, daemon=True).start()

    def _send_event(
        self, action: str, message: str, fields: dict[str, Any], fresh: bool = False
    ) -> None:
        try:
            self.connection.request(wire.Event(action, message, fields), fresh=fresh)
        except CheckpointError:
            pass

    # -- end -------------------------------------------------------------------------------------
    def close(self, wait: bool = True) -> None:
        """Wait for pending commits (an embedded server's writes too), then disconnect."""
        self._copy.close()
        self._ahead.forget()  # before a drain: a region reserved is no save to wait for
        for thread in self._pending:
            thread.join()
        self._next.wait()
        self.settle()  # the server has the last commit before it drains
        if self.server is not None and wait:
            self.server.drain()
        self.connection.close()
        self._maps.clear()
        if self.server is not None:
            self._finalizer.detach()
            self.server.stop()
            self.server = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _env_step(name: str) -> int | None:
    """A step the launcher passed in the environment variable `name`; None when absent."""
    return int(os.environ[name]) if os.environ.get(name) else None
