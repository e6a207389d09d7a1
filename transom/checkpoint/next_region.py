"""The next save's region, mapped and reserved before that save: a save should be a plain copy.

The server keeps a populated spare region ready for each rank's next save (budget.py,
`prepare_spare`), but a worker maps a region it has not seen yet during the save that first
uses it, and filling that mapping's page tables (MAP_POPULATE) costs more than the copy: a
rank's first saves rotate through new regions (memory keeps two steps and a spare), so the 2nd
and 3rd saves of 256 MiB blocked 2-7x the copy floor here, the 4th and later at it. After each
save (and after a load: the next save has the loaded state's size) `NextRegion.after` waits for
the server to take that save in (its older steps are evicted then, and a spare prepared), asks
for the spare of that size and maps it, in a background thread, so the save that takes it
finds it mapped already. Once WARM_SAVES saves of one size have gone by, every region the
server rotates through for them is mapped: it stops asking (a save every step would otherwise
pay two requests and a thread a step), until the size changes or a load comes.

A job that saves every step pays the reserve request's round trip to the server on every step,
on the training thread. `ReservedAhead` takes it off: once two saves came one step apart, an
overlapped save's copy thread asks for the region of the step after it once its commit is
written (so during the next step's forward and backward), without waiting for the reply
(`ServerConnection.send`: the thread never sleeps on it), and that save reads the reply, long
there, and takes the region without asking. A save of another step or size gives the
reservation back and reserves as ever.
Only a save every step reserves ahead: a region reserved steps before its save would hold memory
the node's peers' replicas may need.

This module never blocks a save or a load: `NextRegion`'s request runs on a connection of its
own, one at a time (a request under way makes the next one wait for the save after),
`ReservedAhead`'s on the copy thread; a failure costs only the head start.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

from transom.checkpoint.client import CheckpointError, ServerConnection
from transom.checkpoint.shm import MappingCache
from transom.checkpoint.worker_protocol import Abort, Failed, Prepare, Region, Reserve, Wait
from transom.common.states import Tier

log = logging.getLogger("transom.ckpt")

# How long the mapping waits for the server to finish taking in the save before it.
SAVED_WAIT_S = 30.0
# Saves of one size after which every region the server rotates through is mapped (memory keeps
# two steps, one is being saved, one is a spare).
WARM_SAVES = 4


class NextRegion:
    def __init__(self, connection: ServerConnection, maps: MappingCache[Any], rank: int):
        self.connection = connection
        self.maps = maps
        self.rank = rank
        self._busy = threading.Lock()
        self._size, self._saves = 0, 0  # the size saved lately, and how many saves of it

    def after(self, nbytes: int, saved: int | None = None) -> None:
        """Have the region for a save of `nbytes` mapped before that save, in the background,
        once step `saved` (the save just made, if any) is in the server's memory (nothing when a
        previous one is still under way, there is nothing to save, or WARM_SAVES of this size
        have gone by)."""
        if saved is None or nbytes != self._size:
            self._size, self._saves = nbytes, 0
        self._saves += saved is not None
        if nbytes <= 0 or self._saves > WARM_SAVES or not self._busy.acquire(blocking=False):
            return
        threading.Thread(
            target=self._map_next, args=(nbytes, saved), name="ckpt-next-region", daemon=True
        ).start()

    def _map_next(self, nbytes: int, saved: int | None) -> None:
        try:
            if saved is not None:
                taken = Wait(saved, self.rank, Tier.MEMORY, SAVED_WAIT_S)
                self.connection.request(taken, True, SAVED_WAIT_S + 5.0)
            reply = self.connection.request(Prepare(nbytes, self.rank), True)
            if isinstance(reply, Region):
                self.maps.get(reply.path, nbytes)
        except (CheckpointError, OSError, ValueError) as e:
            log.debug("no region mapped ahead of the next save: %s", e)
        finally:
            self._busy.release()

    def wait(self, timeout: float | None = None) -> None:
        """Until no mapping is under way (an engine closing)."""
        if self._busy.acquire(timeout=-1 if timeout is None else timeout):
            self._busy.release()


class ReservedAhead:
    """The region of the save one step after the last, reserved before that save is made (see
    the module's docstring). `after` runs on the copy thread once a save's commit is written,
    `take` in the save; the copy thread's work is finished before a save begins, so they never
    overlap. The reply to `after`'s request is read by the connection's next request, or by
    `take` or `forget`, whichever comes first."""

    def __init__(self, connection: ServerConnection, rank: int):
        self.connection = connection
        self.rank = rank
        self._last: int | None = None  # the step saved last
        # The reservation, and `ServerConnection.dropped` when it was made.
        self._held: tuple[Reserve, Region, int] | None = None

    def after(self, step: int, nbytes: int, world_size: int, generation: int | None) -> None:
        """Step `step` of `nbytes` is saved: reserve the region of step + 1 if the save before
        it was of step - 1."""
        regular = self._last == step - 1
        self._last = step
        if not regular or nbytes <= 0:
            return
        request = Reserve(step + 1, self.rank, nbytes, world_size, generation, ahead=True)
        dropped = self.connection.dropped

        def reserved(reply: Region | Failed | CheckpointError) -> None:
            if isinstance(reply, Region):
                self._held = (request, reply, dropped)
            else:
                log.debug("no region reserved ahead of step %d: %s", step + 1, reply)

        self.connection.send(request, reserved)

    def take(self, request: Reserve) -> Region | None:
        """The region reserved ahead for `request`'s save, if one was and its connection still
        holds it (the server gives back what a closed connection reserved); a reservation made
        for another save is given back (None: reserve as ever)."""
        self.connection.settle()  # the reply to `after`'s request, unless read already
        held, self._held = self._held, None
        if held is None or held[2] != self.connection.dropped:
            return None
        if dataclasses.replace(held[0], ahead=False) == request:
            return held[1]
        self.give_back(held[0])
        return None

    def forget(self) -> None:
        """Give back a reservation not taken (a load, or the engine closing)."""
        self.connection.settle()  # the reply to `after`'s request, unless read already
        held, self._held = self._held, None
        self._last = None
        if held is not None and held[2] == self.connection.dropped:
            self.give_back(held[0])

    def give_back(self, reserved: Reserve) -> None:
        try:
            reply = self.connection.request(Abort(reserved.step, self.rank))
        except CheckpointError:
            return  # the connection is closed: the server gives the region back itself
        if isinstance(reply, Failed):
            log.debug("the region reserved for step %d: %s", reserved.step, reply.error)
