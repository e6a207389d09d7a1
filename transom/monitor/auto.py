"""Zero-code instrumentation: what the worker bootstrap installs before an unmodified script runs.

A script that never calls `transom.monitor` still gets the monitor's signals, from hooks PyTorch
already has (all installed by `install()`, from transom.control.bootstrap):

- steps: a global optimizer step hook (`torch.optim.optimizer.register_optimizer_step_post_hook`)
  reports a step each time the first optimizer that steps in this process steps again (a second
  optimizer, as in a GAN, is not counted twice). A step's number is the optimizer's own count
  where it keeps one on the CPU (Adam, AdamW and most others: `state[param]["step"]`), which a
  script that resumes from its checkpoint loads back, so numbers go on across restarts;
  otherwise (SGD) steps are counted from 0 in each generation. A step's duration is the time
  since the previous one ended, so the hang rule ("no rank finished a step"), step times and
  progress work for any loop with an optimizer;
- liveness: the heartbeat thread of transom.monitor.reporter, started at once, so a stopped rank
  (no beat) is told apart from one waiting in a collective (beats on);
- the wait: synchronous collectives called from Python (`torch.distributed.all_reduce`, ...)
  are timed, and DDP's gradient all-reduce through a communication hook (the time from the last
  bucket's launch to its completion: the time this rank waited for its peers at the end of the
  backward pass). A step's wait is its `comm`, the rest its `compute`, as `monitor.step`'s
  `sync` section would give them, so "the rank the others wait for" works unmodified;
- saves: `torch.save` and safetensors' `save_file`/`save_model` called from the main thread run
  inside `monitor.phase("checkpoint")` (a save longer than a hang's timeout is no hang: the
  controller waits detectors.PHASE_HANG_S while a rank is in a phase), and their time is left out
  of the step's compared time like a wait: a script whose rank 0 alone writes every few steps
  (a Trainer's checkpoint) does not make rank 0 look like the rank the others wait for;
- evaluations: the trained model's `eval()` to its `train()` (or the next step) is the `eval`
  phase (transom.monitor.eval_phase): an evaluation longer than a hang's timeout is no hang, and
  the step that held it is left out of the timing windows;
- replica fingerprints: every few steps the same hook hashes the parameters it steps
  (transom.monitor.fingerprint) for the controller's replica check, keeps them on the node for
  a replay of that step to compare with (transom.monitor.evidence), and applies an injected
  `corrupt` fault's bit flips (tests, demos) right after the optimizer step.

A script that also uses the explicit API (`monitor.step`, `monitor.report`) keeps its own,
richer reports: from its first explicit call on, the optimizer hook reports no steps (nothing is
counted twice; at most the steps before that call were counted by the hook), only fingerprints.
A framework callback (transom.integrations) sets `framework`: it reports each step with the
framework's own step number and loss, and the timing the hook measured (`take_timing`).

What it must never do: raise into or block training. Every hook swallows its own errors; a
hook that cannot be installed (an older torch, no torch.distributed) is left out; a user's own
DDP communication hook is kept (ours is only registered at the first forward of a model that has
none, and a hook the user registers later replaces ours' all-reduce, still timed).
"""

from __future__ import annotations

import collections
import functools
import os
import statistics
import threading
import time
import weakref
from typing import Any

from transom.common import env
from transom.faults.worker_side import flip_bits
from transom.monitor import eval_phase, evidence, fingerprint, reporter

# The Python-level collectives of torch.distributed whose synchronous calls are timed as wait.
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
)
# The functions that write a checkpoint, (module, name): their calls are a save (`_wrap_saves`).
SAVES = (("torch", "save"), ("safetensors.torch", "save_file"), ("safetensors.torch", "save_model"))
CHECKPOINT_PHASE = "checkpoint"
_WRAPPED = "__transom_timed__"
PERIODS_KEPT = 16  # steps whose times set the default fingerprint interval


class StepCounter:
    """Counts one optimizer's steps and the wait between them; sends each step to the agent."""

    def __init__(self) -> None:
        self.count = 0
        self.primary: weakref.ref | None = None  # the optimizer whose steps are counted
        self.last_end: float | None = None  # perf_counter() of the last counted step's end
        self.wait_s = 0.0  # time in timed collectives and saves since then
        # DDP's gradient all-reduce of the current step: last bucket's launch, last completion.
        self.ddp_launch: float | None = None
        self.ddp_done: float | None = None
        self._lock = threading.Lock()  # DDP's completions run on the process group's thread
        self.saving = False  # the main thread is in a save (`_saving`); a nested one is not timed
        # A framework callback (transom.integrations) reports the steps, with their numbers and
        # loss: the hook then only keeps the newest step's timing for it (`take_timing`).
        self.framework = False
        # The newest step's timing for it; None: that step held an evaluation (not comparable).
        self.timing: dict[str, float] | None = {}
        self.fingerprint_configured = fingerprint.configured()  # None: the default, by step time
        self.fingerprinted: int | None = None  # the step of the newest fingerprint sent
        # The times between the newest counted steps' hooks (the step time the default
        # fingerprint interval is set from), and the newest hook's perf_counter().
        self.periods: collections.deque[float] = collections.deque(maxlen=PERIODS_KEPT)
        self.last_hook: float | None = None
        # The trained model's evaluations (eval() to train()): a phase the next step ends.
        self.evaluating = eval_phase.EvalPhase(lambda: self.primary and self.primary())

    def add_wait(self, seconds: float) -> None:
        with self._lock:
            self.wait_s += seconds

    def ddp_launched(self, now: float) -> None:
        with self._lock:
            self.ddp_launch = now

    def ddp_completed(self, now: float) -> None:
        with self._lock:
            self.ddp_done = now

    def after_step(self, optimizer: Any, args: Any = None, kwargs: Any = None) -> None:
        """The optimizer step post-hook: one step of the first optimizer that stepped."""
        try:
            ch = reporter._get()
            if ch is None:
                return  # no agent
            if self.primary is None or self.primary() is None:
                self.primary = weakref.ref(optimizer)
            elif self.primary() is not optimizer:
                return  # a second optimizer of the same loop: its step is the same step
            evaluated = self.evaluating.take_seen()  # a step: any evaluation is over
            own = optimizer_step(optimizer)
            step = self.count if own is None else own
            self.count = step + 1
            hooked = time.perf_counter()
            if self.last_hook is not None:
                self.periods.append(hooked - self.last_hook)
            self.last_hook = hooked
            if ch.explicit_steps and not self.framework:
                self.check_replica(ch, optimizer, step)
                return  # the script reports its own steps
            now = time.perf_counter()
            with self._lock:
                wait = self.wait_s
                if self.ddp_launch is not None and self.ddp_done is not None:
                    wait += max(0.0, self.ddp_done - self.ddp_launch)
                self.wait_s, self.ddp_launch, self.ddp_done = 0.0, None, None
            message: dict[str, Any] = {"step": step}
            if self.last_end is not None:
                duration = now - self.last_end
                comm = min(wait, duration)
                message.update(dur=duration, comm=comm, compute=duration - comm)
            self.last_end = now
            if evaluated and not self.framework:  # its time held an evaluation: not comparable
                message["phase"] = [eval_phase.EVAL_PHASE]
            if self.framework:
                timed = {k: v for k, v in message.items() if k != "step"}
                self.timing = None if evaluated else timed
                self.check_replica(ch, optimizer, step)
                return
            ch.faults.on_step(step)  # injected faults (tests, demos) fire at counted steps too
            self.check_replica(ch, optimizer, step)
            ch.last_step = step
            ch.send_step(message)
        except Exception:  # noqa: BLE001 - monitoring must never break training
            pass

    def check_replica(self, ch: Any, optimizer: Any, step: int) -> None:
        """An injected corruption due now flips its bits; a due fingerprint goes to the agent
        (transom.monitor.fingerprint): both on the parameters `optimizer` steps."""
        state = ch.faults.state
        if state.corrupt_bits:
            bits, state.corrupt_bits = state.corrupt_bits, 0
            flip_bits(_parameters(optimizer), bits, seed=step)
        if self.fingerprint_due(step):
            self.fingerprinted = step
            tensors = fingerprint.on_host(_parameters(optimizer))
            found = self.kept(step, tensors)
            extra = {} if found is None else {"dev": [list(d) for d in found]}
            ch.send("fingerprint", step=step, fp=fingerprint.digest(tensors), **extra)

    def kept(self, step: int, tensors: list[Any]) -> evidence.Deviations | None:
        """Keep the fingerprinted parameters as the node's evidence (transom.monitor.evidence),
        and return their deviations from an earlier process's of the same step (a replay)."""
        folder = evidence.directory()
        if folder is None:
            return None
        try:
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            job = os.environ.get(env.JOB_ID, "")
            return evidence.record(folder, local_rank, job, step, tensors)
        except (OSError, ValueError, RuntimeError):
            return None  # no evidence this time; the fingerprint still goes out

    def fingerprint_due(self, step: int) -> bool:
        """Whether `step` is fingerprinted (fingerprint.due), at the configured interval or the
        default one for this rank's median step time over its newest steps."""
        first = self.fingerprinted is None
        every = self.fingerprint_configured
        if every is None:  # every default interval is a multiple of DEFAULT_EVERY
            if not first and step % fingerprint.DEFAULT_EVERY:
                return False
            typical = statistics.median(self.periods) if len(self.periods) >= PERIODS_KEPT else None
            every = fingerprint.interval(None, typical)
        return fingerprint.due(step, every, first)

    def take_timing(self) -> dict[str, float] | None:
        """The newest optimizer step's dur, comm and compute (once), for a framework callback;
        None when its time held an evaluation (the step is then reported without a timing)."""
        timing, self.timing = self.timing, {}
        return timing


_counter: StepCounter | None = None
_install_lock = threading.Lock()


def counter() -> StepCounter | None:
    """The installed step counter (None before `install`)."""
    return _counter


def install() -> bool:
    """Install every hook once in this process; True when the monitor channel is there (an agent
    to report to), False (and nothing installed) otherwise. Never raises."""
    global _counter
    with _install_lock:
        if _counter is not None:
            return True
        try:
            if reporter._get() is None:  # starts the heartbeat thread
                return False
        except Exception:  # noqa: BLE001
            return False
        _counter = StepCounter()
        for install_one in (
            _install_optimizer_hook,
            _install_eval_phase,
            _wrap_collectives,
            _install_ddp_hook,
            _wrap_saves,
        ):
            try:
                install_one(_counter)
            except Exception:  # noqa: BLE001 - a torch without this hook: go on without it
                pass
        return True


def _parameters(optimizer: Any) -> list[Any]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def optimizer_step(optimizer: Any) -> int | None:
    """The step just taken, by the optimizer's own count (0 for its first step), where it keeps
    one in its state on the CPU (a count on a GPU is not read: that would wait for the device);
    None otherwise. Reads only: `optimizer.state` is a defaultdict, never indexed here."""
    try:
        first = optimizer.param_groups[0]["params"][0]
        count = (optimizer.state.get(first) or {}).get("step")
        if count is None:
            return None
        if not isinstance(count, (int, float)):
            device = getattr(count, "device", None)
            if getattr(device, "type", None) != "cpu" or count.numel() != 1:
                return None
            count = count.item()
        return max(0, int(count) - 1)
    except (AttributeError, LookupError, TypeError, ValueError, OverflowError):
        return None


def _install_optimizer_hook(steps: StepCounter) -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(steps.after_step)


def _install_eval_phase(steps: StepCounter) -> None:
    eval_phase.install(steps.evaluating)


def _wrap_collectives(steps: StepCounter) -> None:
    """Time the synchronous calls of torch.distributed's collectives (an asynchronous call
    returns a work handle at once: its wait is not seen here)."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None or getattr(original, _WRAPPED, False):
            continue
        setattr(dist, name, _timed(original, steps))


def _timed(original: Any, steps: StepCounter) -> Any:
    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = original(*args, **kwargs)
        if result is None:  # synchronous: it returned once the collective was done
            steps.add_wait(time.perf_counter() - start)
        return result

    setattr(timed, _WRAPPED, True)
    return timed


def _wrap_saves(steps: StepCounter) -> None:
    """Make each of SAVES that can be imported (safetensors is an optional package) a save: a
    checkpoint phase, its time left out of the step like a wait (`_saving`)."""
    import importlib

    for module_name, name in SAVES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        original = getattr(module, name, None)
        if original is not None and not getattr(original, _WRAPPED, False):
            setattr(module, name, _saving(original, steps))


def _saving(original: Any, steps: StepCounter) -> Any:
    """`original` run as a save when called from the main thread and not from inside another
    save (torch.save within a library's save is timed once); as it is otherwise (a background
    writer's save does not hold up the steps)."""

    @functools.wraps(original)
    def save(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread() or steps.saving:
            return original(*args, **kwargs)
        steps.saving = True
        start = time.perf_counter()
        try:
            with reporter.phase(CHECKPOINT_PHASE):
                return original(*args, **kwargs)
        finally:
            steps.saving = False
            steps.add_wait(time.perf_counter() - start)

    setattr(save, _WRAPPED, True)
    return save


class _DDPHookState:
    """Our DDP communication hook's state: the process group, and a user's hook if one came
    after ours (DDP takes one hook per model)."""

    def __init__(self, process_group: Any, steps: StepCounter) -> None:
        self.process_group = process_group
        self.steps = steps
        self.user_hook: Any = None
        self.user_state: Any = None


def _timed_allreduce_hook(state, bucket):
    """DDP's default gradient all-reduce (or the user's hook), its wait timed. (No annotations:
    DDP refuses a hook whose `bucket` or return annotation is not exactly its own types.)"""
    import torch.distributed.distributed_c10d as c10d  # not our timed wrapper: this is async

    state.steps.ddp_launched(time.perf_counter())
    if state.user_hook is not None:
        future = state.user_hook(state.user_state, bucket)
    else:
        # DDP's own all-reduce, bit for bit: without a hook its reducer multiplies each gradient
        # by 1/world as it copies it into the bucket (torch's allreduce_hook divides instead,
        # which rounds differently for a world that is not a power of two).
        group = state.process_group if state.process_group is not None else c10d.group.WORLD
        tensor = bucket.buffer()
        tensor.mul_(1.0 / c10d.get_world_size(group))
        work = c10d.all_reduce(tensor, group=group, async_op=True)
        future = work.get_future().then(lambda f: f.value()[0])

    def done(f: Any) -> Any:
        state.steps.ddp_completed(time.perf_counter())
        return f.value()

    return future.then(done)


def _install_ddp_hook(steps: StepCounter) -> None:
    """Every DistributedDataParallel model gets our communication hook at its first forward,
    unless the script registered its own before; one registered after ours runs inside ours."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if getattr(DDP.__init__, _WRAPPED, False):
        return
    original_init = DDP.__init__
    original_register = DDP.register_comm_hook

    @functools.wraps(original_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        try:
            self.register_forward_pre_hook(_first_forward)
        except Exception:  # noqa: BLE001
            pass

    def _first_forward(module: Any, inputs: Any) -> None:
        if getattr(module, "_transom_hook_state", None) is not None:
            return
        try:
            if module._comm_hooks or getattr(module, "_transom_hook_skipped", False):
                module._transom_hook_skipped = True
                return
            state = _DDPHookState(module.process_group, steps)
            original_register(module, state, _timed_allreduce_hook)
            module._transom_hook_state = state
        except Exception:  # noqa: BLE001 - a model we cannot hook is left as it is
            module._transom_hook_skipped = True

    @functools.wraps(original_register)
    def register(self: Any, state: object, hook: Any) -> None:
        ours = getattr(self, "_transom_hook_state", None)
        if ours is None:
            original_register(self, state, hook)
            return
        self._check_comm_hook(hook)
        ours.user_state, ours.user_hook = state, hook

    setattr(init, _WRAPPED, True)
    DDP.__init__ = init  # type: ignore[method-assign]
    DDP.register_comm_hook = register  # type: ignore[method-assign]
