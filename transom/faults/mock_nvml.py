"""A mock of NVML for machines without a GPU: GPUs whose counters a test or fault sets.

Hand it to `NodeMonitor(node, nvml=MockNvml())` to inject GPU signals (Xid, ECC errors,
throttling) that the monitor's collectors then read as they would from NVML. Nothing in a
production path constructs it. This module must never touch a real GPU.
"""

from __future__ import annotations


class MockNvml:
    """Stands in for `transom.monitor.collect.Nvml`: `read()` returns the counters set here."""

    def __init__(self, gpus: int = 1):
        self.gpus = [
            {
                "util": 50,
                "memory_used": 1 << 30,
                "temperature": 60,
                "ecc_uncorrected": 0,
                "xid": 0,
                "throttle_reasons": 0,
            }
            for _ in range(gpus)
        ]

    def read(self) -> list[dict]:
        return [dict(g, index=i) for i, g in enumerate(self.gpus)]
