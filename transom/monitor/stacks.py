"""Where each stuck rank is: its Python stacks, taken by the agent before a hang is acted on.

The worker bootstrap (transom.control.bootstrap) registers `faulthandler` on STACKS_SIGNAL (SIGURG),
writing the stack of the thread that takes the signal to the rank's stacks file
(RUN_DIR/logs/gNNN/rankR.stacks) after a first line `READY<pid>`; the agent sends the signal to
the main thread alone (tgkill). Never every thread's: faulthandler walks the other threads' frames
while they run, and a rank whose other threads started and ended threads meanwhile was killed by
SIGSEGV once in about 70 such dumps here; none in 22,000 dumps of the main thread alone.

When no rank of its node finished a step for half the time that
would make a hang, or 2 s if half of that time's steps is shorter
(transom.monitor.detectors.suspect_after_s), the agent's monitor asks a `StackCollector` for
the ranks' stacks: a rank whose process is stopped (SIGSTOP, a debugger) or gone is named as
such and not signalled; each other rank is sent STACKS_SIGNAL once, its new stack text read
back (at most MAX_DUMP_BYTES, waiting at most DUMP_WAIT_S), and summed up in one line by
`where`: "in all_reduce at train.py:57" (the library call the script's innermost frame is in,
and that frame's line). The node's monitor summary carries that line per rank, so the
controller's hang anomaly can say "rank 1: stopped; ranks 0, 2: in all_reduce at train.py:57";
the full stacks stay in the files.

What it must never do: signal a process that did not register the handler (only a stacks file
whose first line names that very pid is signalled, and only while the process catches the
signal; its default action is to be ignored, should a library have reset the handler since),
block the agent's loop (the collection runs in a thread of its own), or trust the file's content
(it is parsed defensively and bounded).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
import sysconfig
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from transom.monitor import busy

log = logging.getLogger("transom.monitor")

# A signal whose default action is to be ignored: a library that resets every handler (as
# Lightning's signal connector does at its teardown) leaves the process safe from it. Nothing in
# a training process uses it (it announces a socket's out-of-band data, when asked for).
STACKS_SIGNAL = signal.SIGURG
READY = "transom stacks of pid "
MAX_DUMP_BYTES = 256 * 1024
DUMP_WAIT_S = 2.0
POLL_S = 0.02
MAX_WHERE = 160
# The agent collects stacks once no rank of its node finished a step for this fraction of the
# hang timeout, or of its steps alone (detectors.suspect_after_s), so they are in its summary
# before the controller declares the hang.
SUSPECT_FRACTION = 0.5

STOPPED = "stopped"
GONE = "exited"

# A header of one thread's stack: "Stack (most recent call first):" when only the thread that
# took the signal is dumped, "Current thread 0x..." / "Thread 0x..." when every thread is.
_THREAD = re.compile(r"^(Stack \(most recent call first\)|Current thread 0x|Thread 0x)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.+)$')
_LIBRARY_DIRS = tuple(
    p
    for p in {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    if p
)
_TRANSOM_DIR = str(Path(__file__).resolve().parent.parent)
_WRAPPERS = frozenset({"wrapper", "inner", "decorate_context", "_fn", "timed", "__call__"})


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str


def parse_dump(text: str) -> list[list[Frame]]:
    """The threads of one faulthandler dump, each a list of frames, most recent first."""
    threads: list[list[Frame]] = []
    for line in text.splitlines():
        if _THREAD.match(line):
            threads.append([])
            continue
        m = _FRAME.match(line)
        if m and threads:
            threads[-1].append(Frame(m.group(1), int(m.group(2)), m.group(3).strip()))
    return threads


def _is_library(path: str) -> bool:
    return (
        path.startswith("<")
        or path.startswith(_LIBRARY_DIRS)
        or path.startswith(_TRANSOM_DIR + os.sep)
        or "/site-packages/" in path
    )


def main_thread(threads: list[list[Frame]], script: str) -> list[Frame]:
    """The thread running the script: one with a frame in `script`, else one at a `<module>`
    frame, else the first."""
    script = os.path.abspath(script)
    for frames in threads:
        if any(os.path.abspath(f.file) == script for f in frames):
            return frames
    for frames in threads:
        if any(f.function == "<module>" for f in frames):
            return frames
    return threads[0] if threads else []


def where(frames: list[Frame]) -> str:
    """One line for a stack: "in all_reduce at train.py:57", the library function the rank is
    in and the script's innermost frame; where the script called into a framework that is not
    that function, both: "in backward, from train at train_hf.py:73". The function named is the
    innermost public one (no leading underscore, not a decorator's wrapper, not Transom's)."""
    if not frames:
        return "no Python stack"
    user = next((i for i, f in enumerate(frames) if not _is_library(f.file)), None)
    if user is None:
        top = frames[0]
        return f"in {top.function} at {os.path.basename(top.file)}:{top.line}"[:MAX_WHERE]
    place = f"{os.path.basename(frames[user].file)}:{frames[user].line}"
    called = [
        f
        for f in frames[:user]
        if f.function not in _WRAPPERS and not f.file.startswith(_TRANSOM_DIR + os.sep)
    ]
    if not called:
        return f"at {place} in {frames[user].function}"[:MAX_WHERE]
    outer = called[-1].function
    inner = next((f.function for f in called if not f.function.startswith("_")), outer)
    if inner == outer:
        return f"in {outer} at {place}"[:MAX_WHERE]
    return f"in {inner}, from {outer} at {place}"[:MAX_WHERE]


def group_where(where_by_rank: dict[int, str]) -> str:
    """The ranks' lines in one: ranks with the same line together, stopped and exited ranks
    first, then in the order of each group's first rank, as in
    "rank 1: stopped; ranks 0, 2: in all_reduce at train.py:57"."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(where_by_rank):
        groups.setdefault(where_by_rank[rank][:MAX_WHERE], []).append(rank)
    parts = []
    for text, ranks in sorted(groups.items(), key=lambda g: (g[0] not in (STOPPED, GONE), g[1])):
        label = "rank" if len(ranks) == 1 else "ranks"
        parts.append(f"{label} {', '.join(map(str, ranks))}: {text}")
    return "; ".join(parts)


def handler_ready(path: Path, pid: int) -> bool:
    """Whether `path` says that process `pid` registered the dump handler (its first line)."""
    try:
        with open(path, "rb") as f:
            first = f.readline(200).decode(errors="replace").strip()
    except OSError:
        return False
    return first == f"{READY}{pid}"


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` now (the SigCgt mask of /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def signal_main_thread(pid: int, signum: int) -> None:
    """Send `signum` to the main thread of process `pid` (its thread id is its pid), not to the
    process, whose signal any thread may take (OSError as os.kill raises it)."""
    if _tgkill is None:
        os.kill(pid, signum)  # no tgkill in this C library: the kernel picks the thread
        return
    if _tgkill(pid, pid, signum) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def _find_tgkill() -> Callable[[int, int, int], int] | None:
    try:
        tgkill = ctypes.CDLL(None, use_errno=True).tgkill  # glibc 2.30 and later
    except (OSError, AttributeError):
        return None
    tgkill.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int)
    tgkill.restype = ctypes.c_int
    return tgkill


_tgkill = _find_tgkill()


def dump_many(
    targets: dict[int, tuple[int, Path]], script: str, timeout_s: float = DUMP_WAIT_S
) -> dict[int, list[Frame]]:
    """Signal each target's main thread (key -> (pid, its stacks file)) to dump its stack, all
    at once, and read it back (`main_thread` picks the script's thread from an older dump of every
    thread); a target is left out when its handler is
    not there (never registered, or reset since) or nothing came within `timeout_s`."""
    started: dict[int, tuple[Path, int]] = {}
    for key, (pid, path) in targets.items():
        if not handler_ready(path, pid) or not catches(pid, STACKS_SIGNAL):
            continue
        try:
            before = path.stat().st_size
            signal_main_thread(pid, STACKS_SIGNAL)
        except OSError:
            continue
        started[key] = (path, before)
    sizes = {key: before for key, (_, before) in started.items()}
    settled = dict.fromkeys(started, 0)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(n < 3 for n in settled.values()):
        time.sleep(POLL_S)
        for key, (path, before) in started.items():
            if settled[key] >= 3:
                continue
            try:
                now = path.stat().st_size
            except OSError:
                now = before
            settled[key] = settled[key] + 1 if now == sizes[key] and now > before else 0
            sizes[key] = now
    found: dict[int, list[Frame]] = {}
    for key, (path, before) in started.items():
        if sizes[key] <= before:
            continue
        try:
            with open(path, "rb") as f:
                f.seek(before)
                text = f.read(MAX_DUMP_BYTES).decode(errors="replace")
        except OSError:
            continue
        # A line not yet ended was being written when the dump was read: its frame is left out
        found[key] = main_thread(parse_dump(text[: text.rfind("\n") + 1]), script)
    return found


def process_state(pid: int) -> str | None:
    """STOPPED, GONE, or None for a process that can run."""
    try:
        status = psutil.Process(pid).status()
    except psutil.Error:
        return GONE
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return STOPPED
    if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        return GONE
    return None


@dataclass(frozen=True)
class Collection:
    """What one collection found: each rank's `where` line (STOPPED or GONE for a rank that
    cannot run), and the ranks that worked between its looks (transom.monitor.busy)."""

    where: dict[int, str]
    busy: frozenset[int]


def _look(targets: dict[int, tuple[int, Path]], script: str) -> dict[int, busy.Look]:
    """A look at each target: its CPU times now, then its main thread's stack."""
    t = time.monotonic()
    cpu = {
        rank: (busy.main_thread_cpu_s(pid), busy.children_cpu_s(pid))
        for rank, (pid, _) in targets.items()
    }
    frames = dump_many(targets, script)
    return {
        rank: busy.Look(t, tuple((f.file, f.line, f.function) for f in stack), *cpu[rank])
        for rank, stack in frames.items()
    }


class StackCollector:
    """Collects a node's ranks' `where` lines in a thread of its own, once per request, from
    busy.LOOKS looks busy.LOOK_GAP_S apart, so that it also tells which ranks are at work
    (transom.monitor.busy); `done` (called from that thread) is told when a collection's
    results are in."""

    def __init__(self, done: Callable[[], None] | None = None) -> None:
        self.done = done
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.found: Collection | None = None
        self.key: object = None  # what the last request was for

    def request(self, key: object, ranks: dict[int, tuple[int, Path]], script: str) -> bool:
        """Collect for `ranks` (rank -> (pid, stacks file)) unless already done for `key` or
        a collection is under way; True when one was started."""
        with self._lock:
            if key == self.key or (self._thread is not None and self._thread.is_alive()):
                return False
            self.key = key
            self.found = None
            self._thread = threading.Thread(
                target=self._collect,
                args=(key, dict(ranks), script),
                daemon=True,
                name="stack-collector",
            )
            self._thread.start()
            return True

    def _collect(self, key: object, ranks: dict[int, tuple[int, Path]], script: str) -> None:
        """Where each rank is, and which ranks worked over busy.LOOKS looks busy.LOOK_GAP_S
        apart; where a rank is stopped or gone, the places of the first look go out at once."""
        places: dict[int, str] = {}
        runnable: dict[int, tuple[int, Path]] = {}
        try:
            for rank, (pid, path) in sorted(ranks.items()):
                state = process_state(pid)
                if state is None:
                    runnable[rank] = (pid, path)
                else:
                    places[rank] = state
            first = _look(runnable, script)
            for rank, seen in first.items():
                places[rank] = where([Frame(*f) for f in seen.stack])
            # A stopped rank's hang waits for every place: those go out at once. Otherwise the
            # places go out with the looks' verdict, so that the controller, which waits for
            # every place before it calls a hang, never sees a rank at work as idle.
            halted = any(p in (STOPPED, GONE) for p in places.values())
            if (halted or not first) and not self._found(
                key, Collection(dict(places), frozenset())
            ):
                return
            if not first:
                return
            looks = {rank: [seen] for rank, seen in first.items()}
            for n in range(1, busy.LOOKS):
                taken = min(seen.t for seen in first.values()) + n * busy.LOOK_GAP_S
                time.sleep(max(0.0, taken - time.monotonic()))
                for rank, seen in _look({r: runnable[r] for r in looks}, script).items():
                    looks[rank].append(seen)
            for rank, seen_all in looks.items():
                places[rank] = where([Frame(*f) for f in seen_all[-1].stack])
            working = frozenset(r for r, seen_all in looks.items() if busy.working(seen_all))
            self._found(key, Collection(places, working))
        except Exception:  # noqa: BLE001 - what could not be read is left out
            log.exception("stack collection failed")

    def _found(self, key: object, found: Collection) -> bool:
        """Keep `found` as `key`'s collection and say so (`done`); False when a newer request
        or a reset came since."""
        with self._lock:
            if self.key != key:
                return False
            self.found = Collection({r: w for r, w in found.where.items() if w}, found.busy)
        if self.done is not None:
            self.done()
        return True

    def collecting(self) -> bool:
        """Whether a collection is under way."""
        with self._lock:
            return self._thread is not None and self._thread.is_alive()

    def results(self, key: object) -> Collection | None:
        """The collection for `key`, once it is done."""
        with self._lock:
            return self.found if self.key == key else None

    def reset(self) -> None:
        with self._lock:
            self.key = None
            self.found = None
