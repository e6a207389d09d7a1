"""Overlapped saves: the copy of a save's bytes runs on a thread while training goes on, and the
next optimizer step waits for it.

`Engine.save(..., overlap=True)` plans the state (its tensor table and values: what the header
says) and reserves the region before it returns, as any save does; only the copy of the tensors'
bytes into the region, and the commit after it, run here. The tensors a save holds must not
change until the copy is done: an optimizer's step changes them in place, so every optimizer
step waits for the copy in flight first (a global optimizer pre-step hook, registered while an
engine has copies in flight; a step given a closure waits when the closure returns, after the
forward and backward it runs, before any parameter changes). The state's other tensors must
not change in between either (a forward pass that updates BatchNorm statistics does: save such a
model without `overlap`).
torch's CPU copy releases the GIL, so the copy runs beside the next step's forward and backward.
One copy is in flight at a time: a save, a load and `close` wait for the one before.

This module never plans a state, never talks to a server and never decides what a save holds.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook

# A copy, and what follows it (given the exception the copy raised, or None).
Work = tuple[Callable[[], None], Callable[[BaseException | None], None]]


class CopyInFlight:
    """The one overlapped copy of an engine in flight, and the optimizer hook that waits for it.
    The copies run on one thread, started with the first and kept while the engine lives (a
    thread started for every save costs its start-up on every step)."""

    def __init__(self) -> None:
        self._copied = threading.Event()
        self._finished = threading.Event()
        self._copied.set()
        self._finished.set()
        self._hook: Any = None
        self._work: queue.SimpleQueue[Work | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        weakref.finalize(self, self._work.put, None)  # never closed: its thread ends with it

    def start(self, copy: Callable[[], None], then: Callable[[BaseException | None], None]) -> None:
        """Run `copy` on the copy thread, then `then(the exception copy raised, or None)`; after
        the copy in flight before it has finished."""
        self.wait_finished()
        self._copied.clear()
        self._finished.clear()
        if self._hook is None:
            self._hook = register_optimizer_step_pre_hook(_waiting_for(weakref.ref(self)))
        if self._thread is None:
            self._thread = threading.Thread(
                target=_run, args=(self._work, self._copied, self._finished), daemon=True
            )
            self._thread.name = "ckpt-copy"
            self._thread.start()
        self._work.put((copy, then))

    def wait_copied(self) -> None:
        """Until the copy in flight (if any) has finished copying: its tensors may change."""
        self._copied.wait()

    def wait_finished(self, timeout: float | None = None) -> bool:
        """Until the copy in flight and its commit are done (False: `timeout` passed first)."""
        return self._finished.wait(timeout)

    def close(self) -> None:
        """Wait for the copy in flight, stop the copy thread and stop watching optimizer steps."""
        self.wait_finished()
        if self._thread is not None:
            self._work.put(None)
            self._thread.join()
            self._thread = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _run(
    work: queue.SimpleQueue[Work | None],
    copied: threading.Event,
    finished: threading.Event,
) -> None:
    """The copy thread: each copy, then what follows it, until None. It holds no reference to
    its CopyInFlight (an engine nobody closes is still collected)."""
    while (item := work.get()) is not None:
        copy, then = item
        error: BaseException | None = None
        try:
            copy()
        except BaseException as e:  # noqa: BLE001 - handed to `then`, which reports it
            error = e
        finally:
            copied.set()
        try:
            then(error)
        except Exception:  # noqa: BLE001 - `then` reports its own failures; the thread goes on
            pass
        finally:
            finished.set()


def _waiting_for(ref: weakref.ReferenceType[CopyInFlight]) -> Callable[..., Any]:
    """The optimizer pre-step hook: wait for the copy in flight, or, for a step given a closure
    (Lightning's automatic optimisation, LBFGS: the closure runs the forward and backward inside
    the step), wait when the closure first returns, before the step changes any parameter, so
    the copy still runs beside the forward and backward."""

    def before_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> Any:
        inflight = ref()
        if inflight is None:
            return None
        # `args` are the step's own: the optimizer, then the closure if given by position.
        closure = kwargs.get("closure") if "closure" in kwargs else (args[1:2] or [None])[0]
        if not callable(closure):
            inflight.wait_copied()
            return None

        def closure_then_wait() -> Any:
            try:
                return closure()
            finally:
                inflight.wait_copied()

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_wait}
        return (args[0], closure_then_wait, *args[2:]), kwargs

    return before_optimizer_step
