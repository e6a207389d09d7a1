"""The worker bootstrap: the code every worker runs before the user's script, on both start paths.

A worker starts either forked from its node's warm interpreter (transom.control.warm, whose child
calls `run_script` once its job arrives) or cold, as `python -u -m transom.control.bootstrap
SCRIPT ARGS` (transom.control.workers). Either way `run_script`:

1. titles the process `python -u SCRIPT ARGS` (setproctitle), as a plain start would show;
2. registers `faulthandler` on STACKS_SIGNAL, writing the main thread's Python stack to the rank's
   file in TRANSOM_STACKS_DIR (the agent sends that signal when its ranks look hung, and
   reads the stacks back: transom.monitor.stacks); the dump works even while the rank is inside
   C code, such as a collective;
3. installs the zero-code instrumentation (transom.monitor.auto) unless TRANSOM_AUTO_MONITOR is
   "0" (`--no-auto-monitor`): at once when torch is already imported (a warm interpreter), else
   the moment the script imports torch, so a script that never does pays nothing for it;
4. runs the script as `__main__`, exactly as `python -u SCRIPT ARGS` would;
5. ends the worker as soon as Python's own exit has done what a script may rely on (threads that
   are not daemons, atexit functions, the script's namespace finalized, its open files flushed),
   without the teardown of every module: when the script raises (`exit_after_failure`: with a
   peer dead, tearing down the process group took 1-2 s here, and the agent can report the
   failure, and the job recover, only once the worker has exited), and when it finishes or
   chooses its exit (`exit_after_success`: the teardown of torch's modules took 1.2 s between
   a job's last step and its end).

What it must never do: change what the script computes, fail a worker because an
instrumentation step failed (each step is skipped on error), or cut short what a failing script
still does (its `finally` blocks, threads that are not daemons, atexit functions). It never
signals anything itself.
"""

from __future__ import annotations

import _io
import atexit
import faulthandler
import gc
import importlib.abc
import importlib.machinery
import os
import runpy
import sys
import threading
from pathlib import Path
from types import FunctionType, TracebackType
from typing import IO, Any, NoReturn

from transom.common import env, files
from transom.monitor.stacks import READY, STACKS_SIGNAL

_stacks_file: IO[str] | None = None  # kept open: faulthandler writes to its descriptor


def worker_title(argv: list[str]) -> str:
    """What `ps` shows for a worker: the command line a plain start would have."""
    return " ".join([sys.executable, "-u", *argv])


def instrumentation_env(stacks_dir: Path | None, evidence_dir: Path) -> dict[str, str]:
    """The variables a worker's bootstrap reads: where to write its stacks (and with it the
    zero-code monitor) and its replica evidence (transom.monitor.evidence), or, when
    `stacks_dir` is None (`--no-auto-monitor`), none of them."""
    if stacks_dir is None:
        return {env.AUTO_MONITOR: "0"}
    return {env.STACKS_DIR: str(stacks_dir), env.EVIDENCE_DIR: str(evidence_dir)}


def register_stack_dump() -> bool:
    """Dump the stack of the thread that takes STACKS_SIGNAL (the agent signals the main thread)
    to this rank's file in TRANSOM_STACKS_DIR; False if not asked for (no directory named) or not
    possible. Never every thread's: that dump reads threads' frames as they run, and crashes."""
    global _stacks_file
    directory = os.environ.get(env.STACKS_DIR)
    if not directory or _stacks_file is not None:
        return False
    try:
        path = os.path.join(directory, files.stacks_name(int(os.environ["RANK"])))
        _stacks_file = open(path, "w")  # noqa: SIM115 - lives as long as the process
        faulthandler.register(STACKS_SIGNAL, file=_stacks_file, all_threads=False, chain=False)
        # The agent signals only a process whose pid this first line names (transom.monitor.stacks)
        _stacks_file.write(f"{READY}{os.getpid()}\n")
        _stacks_file.flush()
        return True
    except (OSError, ValueError, RuntimeError, KeyError):
        return False


def install_monitor() -> None:
    """The zero-code instrumentation, now if torch is imported, else when the script imports it."""
    if os.environ.get(env.AUTO_MONITOR) == "0" or not os.environ.get(env.MONITOR_SOCKET):
        return
    try:
        from transom.monitor import auto, reporter

        reporter._get()  # the heartbeat starts now, whether the script ever imports torch
        if "torch" in sys.modules:
            auto.install()
        else:
            sys.meta_path.insert(0, _AfterImport("torch", auto.install))
    except Exception:  # noqa: BLE001 - the script runs without instrumentation rather than fail
        pass


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then()` once module `name` has been imported (its loader wrapped, then removed)."""

    def __init__(self, name: str, then: Any) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, then = spec.loader, self.then

        class Loader(importlib.abc.Loader):
            def __getattr__(self, name: str) -> Any:  # get_resource_reader and the like
                return getattr(loader, name)

            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                try:
                    then()
                except Exception:  # noqa: BLE001
                    pass

        spec.loader = Loader()
        return spec


def run_script(argv: list[str]) -> None:
    """Become the worker: title, stack dump, instrumentation, then `SCRIPT ARGS` as __main__."""
    try:
        import setproctitle

        setproctitle.setproctitle(worker_title(argv))
    except Exception:  # noqa: BLE001 - a title is for operators only
        pass
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    register_stack_dump()
    install_monitor()
    try:
        namespace: dict[str, Any] | None = runpy.run_path(script, run_name="__main__")
        status = 0
    except KeyboardInterrupt:
        flush_open_files()
        raise  # an interrupt: Python's own way
    except SystemExit as e:  # an exit the script chose
        status = exit_status(e)
        namespace = script_globals(e.__traceback__, script)
    except BaseException as e:  # noqa: BLE001 - every failure of the script
        exit_after_failure(e)
    exit_after_success(status, namespace)


def flush_open_files() -> None:
    """Flush every file object open for writing, stdout and stderr included (one that cannot
    flush is left as it is)."""
    # io.IOBase's C base: the same objects (every file class derives from it), without the ABC's
    # instance check on each of a torch worker's 300,000 objects (0.05 s, not 0.2 s). By type:
    # isinstance also reads an object's __class__, which some intercept (torch.distributed's
    # deprecated reduce_op warns on every attribute read).
    for obj in [*gc.get_objects(), sys.stdout, sys.stderr]:
        if issubclass(type(obj), _io._IOBase):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except Exception:  # noqa: BLE001 - a file that cannot flush: nothing to keep
                pass


def exit_status(exit: SystemExit) -> int:
    """The status Python exits with for `exit` (a code that is not a number is printed, and 1)."""
    code = exit.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def script_globals(tb: TracebackType | None, script: str) -> dict[str, Any] | None:
    """The namespace the script ran in, from the traceback of an exit it raised (None if the
    traceback does not pass through the script's module code)."""
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "<module>" and code.co_filename == script:
            return tb.tb_frame.f_globals
        tb = tb.tb_next
    return None


def exit_after_success(status: int, namespace: dict[str, Any] | None) -> NoReturn:
    """End a worker whose script finished (or chose its exit) as Python would, less the teardown
    of every module: wait for the threads that are not daemons, run the atexit functions, then
    clear the script's namespace and collect (the objects only it held are finalized, as the
    teardown of `__main__` would), flush every open file, and exit with `status`. The teardown
    of the modules a torch script imported took 1.2 s a worker on a quiet machine, between its
    last step and the agent's report that the job is done."""
    try:
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
        if namespace is not None:
            clear_namespace(namespace)
    finally:
        flush_open_files()
        os._exit(status)


def clear_namespace(namespace: dict[str, Any]) -> None:
    """Clear the script's namespace and collect, so that what only it held is finalized. runpy
    returns a copy of it: the script's own dict is found through the functions the script
    defined (their globals; an atexit function keeps it alive otherwise)."""
    dicts = {id(namespace): namespace}
    for value in list(namespace.values()):
        if isinstance(value, FunctionType):
            own = value.__globals__
            if own.get("__file__") == namespace.get("__file__"):
                dicts[id(own)] = own
    for d in dicts.values():
        d.clear()
    gc.collect()


def exit_after_failure(error: BaseException) -> NoReturn:
    """End a worker whose script raised `error` with status 1, as Python would, less the
    interpreter's teardown: the traceback through `sys.excepthook` (torch's prefixes each line
    with the rank), then what Python's exit does before its teardown, in its order (wait for the
    threads that are not daemons, run the atexit functions), then flush every open file (the
    teardown would have: a script's own log file left open keeps its last lines); then the
    process ends. The teardown destroys the process group, and with a peer dead that took 1-2 s
    here: time the agent waits before it can report the failure."""
    sys.excepthook(type(error), error, error.__traceback__)
    try:
        shutdown = getattr(threading, "_shutdown", None)  # what Py_FinalizeEx calls first
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
    finally:
        flush_open_files()
        os._exit(1)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m transom.control.bootstrap SCRIPT [ARGS...]")
    run_script(sys.argv[1:])
