"""The checkpoint engine's GPU path, measured on a machine with a CUDA GPU.

A save of CUDA tensors copies them asynchronously into the node server's shared memory,
registered with CUDA as pinned memory (transom/checkpoint/pinning.py). Per run it reports:
  floor_s                the state copied into a pinned buffer torch allocated (the hardware's
                         device-to-host floor); pageable_copy_s: `{k: v.cpu()}`, the snapshot a
                         torch.save starts with; torch_save_s: torch.save of the CUDA state
  transom_first_save_s   blocking part of the first Engine.save (region created and registered)
  transom_save_s         blocking part of a save after Engine.prepare (median of SAVES);
                         transom_staged_s: save -> in the memory tier (copy done, checksummed)
  consistent             a save followed at once by in-place updates of every tensor (training
                         going on) holds the values from before them, bit for bit, from memory
                         and from storage loaded back onto the GPU
  turnover               ROUNDS saves of a growing state under a budget of a few regions, so the
                         server destroys the regions the worker had registered: the slowest
                         save's blocking time, the registrations refused, and the host memory
                         not given back once the engine is closed (`not_returned_gib`)
  nvml                   transom.monitor.collect.Nvml on this GPU: the fields it reads and the
                         cost of one read (the node agent reads once a poll)

    python -m benchmarks.checkpoint_gpu                # 1 GiB state; a summary
    python -m benchmarks.checkpoint_gpu --gib 4 --json # ... and one JSON object on the last line
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch  # noqa: E402

from benchmarks.checkpoint import GIB, TENSOR_BYTES, flat_tensors, make_state  # noqa: E402
from transom import checkpoint  # noqa: E402
from transom.monitor.collect import Nvml  # noqa: E402

SAVES = 5
ROUNDS = 10
NVML_READS = 20


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def baselines(state: dict, work: Path) -> dict:
    flat = flat_tensors(state)
    pinned = torch.empty(sum(t.numel() for t in flat), dtype=torch.float32, pin_memory=True)

    def floor() -> None:
        offset = 0
        for t in flat:
            pinned[offset : offset + t.numel()].copy_(t, non_blocking=True)
            offset += t.numel()
        torch.cuda.synchronize()

    floor()
    r = {"floor_s": statistics.median(timed(floor) for _ in range(3))}
    r["pageable_copy_s"] = statistics.median(
        timed(lambda: [t.cpu() for t in flat]) for _ in range(3)
    )
    r["torch_save_s"] = timed(lambda: torch.save(state, work / "torch.pt"))
    (work / "torch.pt").unlink()
    return r


def engine_saves(state: dict, work: Path) -> dict:
    r: dict = {}
    with checkpoint.Engine(storage_dir=work / "saves", rank=0, world_size=1) as engine:
        t0 = time.perf_counter()
        h = engine.save(1, state)
        r["transom_first_save_s"] = time.perf_counter() - t0
        h.wait("memory")
        blocking, staged = [], []
        for step in range(2, 2 + SAVES):
            engine.prepare(state)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            h = engine.save(step, state)
            blocking.append(time.perf_counter() - t0)
            h.wait("memory")
            staged.append(time.perf_counter() - t0)
            assert h.ok, h.error
        r["transom_save_s"] = statistics.median(blocking)
        r["transom_staged_s"] = statistics.median(staged)
    return r


def consistent(state: dict, work: Path) -> bool:
    """A save, then every tensor changed in place at once: the checkpoint holds the old values."""
    before = [t.cpu() for t in flat_tensors(state)]
    with checkpoint.Engine(storage_dir=work / "consistent", rank=0, world_size=1) as engine:
        h = engine.save(7, state)
        for t in flat_tensors(state):
            t.add_(1.0)  # queued behind the copy on the same stream, as a training step's are
        h.wait("storage")
        from_memory = engine.load(7, tier="memory")
        from_storage = engine.load(7, tier="storage", map_location="cuda")
    on_gpu = all(t.is_cuda for t in flat_tensors(from_storage))
    same = all(
        torch.equal(a, b) and torch.equal(a, c.cpu())
        for a, b, c in zip(
            before, flat_tensors(from_memory), flat_tensors(from_storage), strict=True
        )
    )
    return on_gpu and same


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def turnover(nbytes: int, work: Path) -> dict:
    """Saves of a state growing by one tensor a round, under a budget of about three regions:
    the server destroys the regions of earlier sizes, which the worker had registered."""
    warnings = Warnings()
    logging.getLogger().addHandler(warnings)
    gc.collect()
    before = mem_available()
    state = make_state(nbytes, 0, device="cuda")
    budget = int(3 * (nbytes + ROUNDS * TENSOR_BYTES))
    blocking = []
    with checkpoint.Engine(
        storage_dir=work / "turnover", rank=0, world_size=1, memory_bytes=budget
    ) as engine:
        for step in range(ROUNDS):
            state["model"][f"extra{step}"] = torch.randn(TENSOR_BYTES // 4, device="cuda")
            engine.prepare(state)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            h = engine.save(step, state, persist=False)
            blocking.append(time.perf_counter() - t0)
            h.wait("memory")
    del state, engine, h
    gc.collect()
    torch.cuda.empty_cache()
    logging.getLogger().removeHandler(warnings)
    return {
        "rounds": ROUNDS,
        "save_worst_s": max(blocking[1:]),
        "save_median_s": statistics.median(blocking[1:]),
        "register_failures": sum("cudaHostRegister failed" in m for m in warnings.messages),
        "not_returned_gib": max(0, before - mem_available()) / GIB,
    }


def nvml() -> dict:
    n = Nvml()
    if not n.available:
        return {"available": False}
    n.read()
    t0 = time.perf_counter()
    for _ in range(NVML_READS):
        gpus = n.read()
    read_ms = (time.perf_counter() - t0) / NVML_READS * 1e3
    fields = {k: v for k, v in gpus[0].items() if v is not None}
    unread = sorted(k for k, v in gpus[0].items() if v is None)
    return {"available": True, "read_ms": read_ms, "gpu0": fields, "unsupported": unread}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("checkpoint_gpu.py needs a CUDA GPU; none is visible here", file=sys.stderr)
        return 2
    nbytes = int(args.gib * GIB)
    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    result["gib"] = args.gib
    with tempfile.TemporaryDirectory(prefix="transom-ckpt-gpu-") as tmp:
        work = Path(tmp)
        state = make_state(nbytes, 0, device="cuda")
        result |= baselines(state, work)
        result |= engine_saves(state, work)
        result["save_vs_floor_x"] = result["transom_save_s"] / result["floor_s"]
        result["staged_vs_floor_x"] = result["transom_staged_s"] / result["floor_s"]
        result["consistent"] = consistent(state, work)
        del state
        result["turnover"] = turnover(nbytes, work)
    result["nvml"] = nvml()
    for key, value in result.items():
        print(f"{key:24} {value:.4f}" if isinstance(value, float) else f"{key:24} {value}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
