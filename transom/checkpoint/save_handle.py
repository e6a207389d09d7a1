"""A save in progress, as `Engine.save` returns it: whether it was taken, and `wait(tier)`.

    h = engine.save(step, state)
    h.ok, h.error, h.blocking_s          # refused at once? why; how long the save blocked
    h.wait("peer"); h.wait("storage")    # until the shard reached that tier (or could not)
    h.persist()                          # a save made with persist=False: to storage too

`wait` reads the commit's reply first (engine.py sends it without waiting), then asks the
node's server in rounds of WAIT_POLL_S on a connection of its own, so a server that stops
answering is noticed. This module never copies shard bytes and never decides what a save does.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Protocol

from transom.checkpoint.client import CheckpointError, ServerConnection
from transom.checkpoint.protocol import deadline_in
from transom.checkpoint.worker_protocol import Failed, Persist, Wait
from transom.common.states import Tier

# The tier names of earlier releases, accepted by `SaveHandle.wait` with a DeprecationWarning.
DEPRECATED_TIERS = {"replicated": Tier.PEER, "persisted": Tier.STORAGE}
# `SaveHandle.wait` without a timeout asks the server again every this many seconds, so a server
# that stops answering is noticed.
WAIT_POLL_S = 60.0


class Saver(Protocol):
    """What a handle asks of the engine that made it (engine.Engine)."""

    connection: ServerConnection
    request_timeout_s: float

    def settle(self, timeout: float | None = None) -> None: ...


class SaveRefused(CheckpointError):
    """The node's checkpoint server refused a save (memory budget, or no answer in time);
    training can go on."""


class SaveHandle:
    """A save in progress: `wait(tier)` for a `Tier`: "memory", "peer" or "storage"."""

    def __init__(self, engine: Saver, step: int, rank: int, error: str | None = None):
        self.engine = engine
        self.step = step
        self.rank = rank
        self.error = error
        self.blocking_s = 0.0
        self._committed = threading.Event()
        if error is not None:
            self._committed.set()

    @property
    def ok(self) -> bool:
        """False once the save is known to have failed: at once when the server refused it, or
        when its commit's reply said so (read with the engine's next request, or by `wait`)."""
        return self.error is None

    def wait(self, tier: Tier | str = Tier.STORAGE, timeout: float | None = None) -> None:
        """Return once the shard has reached `tier`; CheckpointError if it cannot (TimeoutError
        when `timeout` passes first)."""
        tier = _tier(tier)
        deadline = deadline_in(timeout)
        if not self._committed.is_set():
            self.engine.settle(timeout)  # the commit's reply, unless read already
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._committed.wait(left):
            raise TimeoutError(f"step {self.step} not staged within {timeout} s")
        if self.error is not None:
            raise SaveRefused(self.error)
        while True:  # without a timeout: in rounds of WAIT_POLL_S, each answered in time
            left = WAIT_POLL_S if deadline is None else max(0.0, deadline - time.monotonic())
            reply = self.engine.connection.request(
                Wait(self.step, self.rank, tier, left),
                fresh=True,
                timeout=left + self.engine.request_timeout_s,
            )
            if not (isinstance(reply, Failed) and reply.timeout and deadline is None):
                break
        if isinstance(reply, Failed) and reply.timeout:
            raise TimeoutError(reply.error)
        if isinstance(reply, Failed):
            raise CheckpointError(
                f"step {self.step} rank {self.rank} did not reach {tier}: {reply.error}"
            )

    def persist(self) -> None:
        """Send this save, made with `persist=False`, to storage too, in the background as a save
        with `persist` (every rank must, for the step to be complete in storage); once its copy
        is in memory. SaveRefused when the save failed, CheckpointError when the server no
        longer holds it (evicted)."""
        self.wait(Tier.MEMORY)
        reply = self.engine.connection.request(Persist(self.step, self.rank), fresh=True)
        if isinstance(reply, Failed):
            raise CheckpointError(f"step {self.step} not persisted: {reply.error}")


def _tier(tier: Tier | str) -> Tier:
    """`tier` as a Tier; the names of earlier releases with a DeprecationWarning."""
    if isinstance(tier, str) and tier in DEPRECATED_TIERS:
        new = DEPRECATED_TIERS[tier]
        warnings.warn(
            f"tier {tier!r} is now called {new.value!r}", DeprecationWarning, stacklevel=3
        )
        return new
    return Tier.parse(tier)
