"""`ExitWatch`: a callback the moment one of some processes exits, from Linux pidfds.

A loop that polls its processes every tick learns of an exit up to a tick late; an agent's tick
is 0.2 s, a tenth of a worker crash's whole recovery. The watch's thread waits on a pidfd per
process (readable once it has exited: a child of another process, such as a worker the warm
interpreter forked, as well as one's own) and calls `on_exit` with its pid; `exited` holds the
pids seen to exit.

Best-effort: where pidfds are not available (os.pidfd_open: Linux 5.3, Python 3.9) or a process
is gone before it is watched, nothing is called for it, and the caller's polling finds the exit
as before. It never signals, waits for or reaps a process. `on_exit` runs on the watch's
thread: it must be quick and thread-safe, and must not raise.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from collections.abc import Callable, Iterable

log = logging.getLogger("transom.exit_watch")

JOIN_S = 1.0


class ExitWatch:
    def __init__(self, pids: Iterable[int], on_exit: Callable[[int], None]) -> None:
        self.on_exit = on_exit
        self.exited: set[int] = set()
        self._fds: dict[int, int] = {}  # pidfd -> pid
        for pid in pids:
            try:
                self._fds[os.pidfd_open(pid)] = pid
            except (AttributeError, OSError):
                continue  # no pidfds here, or already gone: the caller's polling finds it
        self._stop_r, self._stop_w = os.pipe()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="exit-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        waiting = set(self._fds)
        while waiting:
            try:
                ready = select.select([self._stop_r, *waiting], [], [])[0]
            except (OSError, ValueError):
                return  # closed under it: the watch is over
            if self._stop_r in ready:
                return
            for fd in ready:
                waiting.discard(fd)
                pid = self._fds[fd]
                self.exited.add(pid)
                try:
                    self.on_exit(pid)
                except Exception:  # noqa: BLE001 - a caller's bug must not end the watch
                    log.exception("exit watch: the callback failed for pid %d", pid)

    def close(self) -> None:
        """End the thread and release the pidfds (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        os.write(self._stop_w, b"x")
        self._thread.join(JOIN_S)
        if self._thread.is_alive():
            return  # leave its descriptors to it rather than close them under a select
        for fd in [*self._fds, self._stop_r, self._stop_w]:
            os.close(fd)
        self._fds.clear()
