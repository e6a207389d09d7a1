"""Collectors the node agent polls: host metrics, GPU metrics, and new lines of worker logs.

GPU metrics come from NVML (nvidia-ml-py) when a GPU is present, else nothing (tests inject GPU
signals through transom.faults.MockNvml, which reads like `Nvml`).
Collectors only read; they never judge (detectors.py does) and never act (the policy does).
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil

from transom.common import anomalies
from transom.monitor import patterns

LOG_READ_LIMIT = 1 << 20  # bytes read from one log per poll at most
# Clock-throttle reasons that mean trouble (NVML bit masks): hardware slowdown, thermal, power
# brake.
BAD_THROTTLE_MASK = 0x8 | 0x20 | 0x40 | 0x80


def host_metrics() -> dict:
    vm = psutil.virtual_memory()
    return {
        "cpu_percent": psutil.cpu_percent(interval=None),
        "memory_used_fraction": vm.percent / 100.0,
        "memory_available_bytes": vm.available,
        "load_1m": os.getloadavg()[0],
    }


class Nvml:
    """Real NVML through nvidia-ml-py; `available` is False without a GPU and driver."""

    def __init__(self) -> None:
        self.available = False
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.count = pynvml.nvmlDeviceGetCount()
            self.available = self.count > 0
        except Exception:  # noqa: BLE001 - no driver, no library, no GPU: no GPU metrics
            self.count = 0

    def read(self) -> list[dict]:
        if not self.available:
            return []
        n, out = self.nvml, []
        for i in range(self.count):
            try:
                h = n.nvmlDeviceGetHandleByIndex(i)
                g = {
                    "index": i,
                    "util": n.nvmlDeviceGetUtilizationRates(h).gpu,
                    "memory_used": n.nvmlDeviceGetMemoryInfo(h).used,
                    "temperature": n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
                    "throttle_reasons": n.nvmlDeviceGetCurrentClocksThrottleReasons(h),
                    "xid": 0,
                }
                try:
                    g["ecc_uncorrected"] = n.nvmlDeviceGetTotalEccErrors(
                        h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC
                    )
                except n.NVMLError:
                    g["ecc_uncorrected"] = 0
            except n.NVMLError as e:
                g = {"index": i, "error": str(e)}
            out.append(g)
        return out


def gpu_problems(before: list[dict], now: list[dict]) -> list[tuple[str, str, bool]]:
    """(type, message, hardware) for each GPU whose Xid/ECC counters grew or that throttles hard."""
    old = {g["index"]: g for g in before}
    found = []
    for g in now:
        prev = old.get(g["index"], {})
        if "error" in g:
            found.append((anomalies.GPU_LOST, f"GPU {g['index']}: NVML error {g['error']}", True))
            continue
        if g.get("xid", 0) > prev.get("xid", 0):
            found.append((anomalies.XID, f"GPU {g['index']}: Xid error count {g['xid']}", True))
        if g.get("ecc_uncorrected", 0) > prev.get("ecc_uncorrected", 0):
            found.append(
                (
                    anomalies.ECC,
                    f"GPU {g['index']}: {g['ecc_uncorrected']} uncorrected ECC errors",
                    True,
                )
            )
        if (
            g.get("throttle_reasons", 0) & BAD_THROTTLE_MASK
            and not prev.get("throttle_reasons", 0) & BAD_THROTTLE_MASK
        ):
            found.append(
                (
                    "gpu_throttle",
                    f"GPU {g['index']}: clocks throttled (reasons 0x{g['throttle_reasons']:x})",
                    False,
                )
            )
    return found


class LogScanner:
    """Reads what was appended to each rank's log since the last poll and classifies each line."""

    def __init__(self) -> None:
        self.offsets: dict[Path, int] = {}
        self.partial: dict[Path, str] = {}

    def poll(self, logs: dict[int, Path]) -> list[tuple[int, patterns.Pattern, str]]:
        found = []
        for rank, path in logs.items():
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets.get(path, 0))
                    data = f.read(LOG_READ_LIMIT)
            except OSError:
                continue
            if not data:
                continue
            self.offsets[path] = self.offsets.get(path, 0) + len(data)
            text = self.partial.pop(path, "") + data.decode(errors="replace")
            lines = text.split("\n")
            if lines[-1]:
                self.partial[path] = lines[-1]
            for line in lines[:-1]:
                pattern = patterns.classify(line)
                if pattern is not None:
                    found.append((rank, pattern, line))
        return found
