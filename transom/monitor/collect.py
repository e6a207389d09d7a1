"""Collectors the node agent polls: host metrics, GPU metrics, and new lines of worker logs.

GPU metrics come from NVML (nvidia-ml-py) when a GPU is present, else nothing (tests inject GPU
signals through transom.faults.MockNvml, which reads like `Nvml`). ECC and Xid faults are judged
from NVML's counters and events here, never from free text; log lines are classified by
transom.monitor.patterns.
Collectors only read; they never judge (detectors.py does) and never act (the policy does).
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil

from transom.common import anomaly_types
from transom.monitor import patterns

LOG_READ_LIMIT = 1 << 20  # bytes read from one log per poll at most
# Clock-throttle reasons that mean trouble (NVML bit masks): hardware slowdown, thermal, power
# brake.
BAD_THROTTLE_MASK = 0x8 | 0x20 | 0x40 | 0x80
XID_EVENTS_PER_READ = 64  # Xid events taken from NVML's queue per read at most
XID_CODES_KEPT = 32  # newest Xid numbers kept per GPU


def host_metrics() -> dict:
    vm = psutil.virtual_memory()
    return {
        "cpu_percent": psutil.cpu_percent(interval=None),
        "memory_used_fraction": vm.percent / 100.0,
        "memory_available_bytes": vm.available,
        "load_1m": os.getloadavg()[0],
    }


class Nvml:
    """Real NVML through nvidia-ml-py; `available` is False without a GPU and driver.

    Per GPU `read()` gives utilisation, memory, temperature, throttle reasons, the volatile
    uncorrected ECC count, the row remapper's uncorrectable rows and failure flag, and `xid`: the
    number of critical Xid events NVML delivered so far, with their numbers in `xid_codes` (the
    newest XID_CODES_KEPT). Only NVML's "GPU is lost" makes a GPU `lost`; a metric this GPU or
    driver does not support reads as None.
    """

    def __init__(self) -> None:
        self.available = False
        self.count = 0
        self._events = None
        self._xids: dict[int, list[int]] = {}
        self._xid_counts: dict[int, int] = {}
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.count = pynvml.nvmlDeviceGetCount()
            self.available = self.count > 0
        except Exception:  # noqa: BLE001 - no driver, no library, no GPU: no GPU metrics
            return
        self._register_xid_events()

    def _register_xid_events(self) -> None:
        n = self.nvml
        try:
            self._events = n.nvmlEventSetCreate()
        except n.NVMLError:
            return
        for i in range(self.count):
            try:
                n.nvmlDeviceRegisterEvents(
                    n.nvmlDeviceGetHandleByIndex(i), n.nvmlEventTypeXidCriticalError, self._events
                )
            except n.NVMLError:  # not supported on this GPU, or no permission: no Xid events
                continue

    def _drain_xid_events(self) -> None:
        """Take every Xid event NVML queued since the last read, without waiting."""
        n = self.nvml
        if self._events is None:
            return
        for _ in range(XID_EVENTS_PER_READ):
            try:
                event = n.nvmlEventSetWait_v2(self._events, 0)
                index = n.nvmlDeviceGetIndex(event.device)
            except n.NVMLError:  # NVML_ERROR_TIMEOUT: nothing queued
                return
            codes = self._xids.setdefault(index, [])
            codes.append(int(event.eventData))
            del codes[:-XID_CODES_KEPT]
            self._xid_counts[index] = self._xid_counts.get(index, 0) + 1

    def read(self) -> list[dict]:
        if not self.available:
            return []
        self._drain_xid_events()
        return [self._read_gpu(i) for i in range(self.count)]

    def _read_gpu(self, i: int) -> dict:
        n = self.nvml
        g: dict = {"index": i}
        try:
            h = n.nvmlDeviceGetHandleByIndex(i)
        except n.NVMLError as e:
            return _lost_or_unreadable(g, e, n)
        reads = {
            "util": lambda: n.nvmlDeviceGetUtilizationRates(h).gpu,
            "memory_used": lambda: n.nvmlDeviceGetMemoryInfo(h).used,
            "temperature": lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
            "throttle_reasons": lambda: n.nvmlDeviceGetCurrentClocksThrottleReasons(h),
            "ecc_uncorrected": lambda: n.nvmlDeviceGetTotalEccErrors(
                h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC
            ),
            "remap": lambda: n.nvmlDeviceGetRemappedRows(h),
        }
        for key, read in reads.items():
            try:
                g[key] = read()
            except n.NVMLError as e:
                if e.value == n.NVML_ERROR_GPU_IS_LOST:
                    return _lost_or_unreadable({"index": i}, e, n)
                g[key] = None  # not supported here (no ECC, no row remapper), no permission
        remap = g.pop("remap")
        # (correctable rows, uncorrectable rows, remapping pending, remapping failed)
        g["remapped_uncorrectable"] = remap[1] if remap else None
        g["remap_failed"] = bool(remap[3]) if remap else None
        g["xid"] = self._xid_counts.get(i, 0)
        g["xid_codes"] = list(self._xids.get(i, []))
        return g


def _lost_or_unreadable(g: dict, e: Exception, n) -> dict:
    if getattr(e, "value", None) == n.NVML_ERROR_GPU_IS_LOST:
        g["lost"] = str(e)
    else:
        g["unreadable"] = str(e)
    return g


def gpu_problems(before: list[dict], now: list[dict]) -> list[tuple[str, str, bool]]:
    """(type, message, hardware) for each GPU whose counters show a new fault since `before`.

    Hardware: NVML says the GPU is lost; an Xid that NVIDIA's catalogue ties to the hardware
    (an Xid count without its numbers, as a mock gives, counts as hardware); the uncorrected ECC
    count or the row remapper's uncorrectable rows grew; row remapping failed. Warnings: an
    application's or another non-hardware Xid; clocks newly throttled for a bad reason.
    """
    old = {g["index"]: g for g in before}
    found: list[tuple[str, str, bool]] = []
    for g in now:
        i, prev = g["index"], old.get(g["index"], {})
        if "lost" in g:
            found.append((anomaly_types.GPU_LOST, f"GPU {i}: NVML: {g['lost']}", True))
            continue
        if "unreadable" in g:
            continue  # NVML could not open it for another reason: no reading, no verdict
        new_xids = (g.get("xid") or 0) - (prev.get("xid") or 0)
        if new_xids > 0:
            codes = (g.get("xid_codes") or [])[-new_xids:]
            for code in codes:
                type_ = patterns.xid_type(code)
                found.append(
                    (type_, f"GPU {i}: Xid {code} (NVML event)", type_ == anomaly_types.XID)
                )
            if not codes:
                found.append((anomaly_types.XID, f"GPU {i}: Xid error count {g['xid']}", True))
        for key, what in (
            ("ecc_uncorrected", "uncorrected ECC errors"),
            ("remapped_uncorrectable", "rows remapped for uncorrectable ECC errors"),
        ):
            if (g.get(key) or 0) > (prev.get(key) or 0):
                found.append((anomaly_types.ECC, f"GPU {i}: {g[key]} {what}", True))
        if g.get("remap_failed") and not prev.get("remap_failed"):
            found.append((anomaly_types.ECC, f"GPU {i}: row remapping failed", True))
        reasons, was = g.get("throttle_reasons") or 0, prev.get("throttle_reasons") or 0
        if reasons & BAD_THROTTLE_MASK and not was & BAD_THROTTLE_MASK:
            found.append(
                ("gpu_throttle", f"GPU {i}: clocks throttled (reasons 0x{reasons:x})", False)
            )
    return found


class LogScanner:
    """Reads what was appended to each rank's log since the last poll and classifies each line."""

    def __init__(self) -> None:
        self.offsets: dict[Path, int] = {}
        self.partial: dict[Path, str] = {}

    def poll(self, logs: dict[int, Path]) -> list[tuple[int, patterns.Classification, str]]:
        found = []
        for rank, path in logs.items():
            try:
                if os.stat(path).st_size <= self.offsets.get(path, 0):
                    continue  # nothing appended (a stat is cheaper than an open, every tick)
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
                classified = patterns.classify(line)
                if classified is not None:
                    found.append((rank, classified, line))
        return found
