"""The monitor's collectors without a GPU: NVML through a fake pynvml, worker logs in tmp files.

GPU faults come from NVML's counters and events (Xid numbers judged by NVIDIA's catalogue, ECC
counts, the row remapper), never from free text; a metric NVML does not support is no fault.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

from transom.common import anomaly_types
from transom.monitor.collect import LogScanner, Nvml, gpu_problems

NOT_SUPPORTED, GPU_IS_LOST, TIMEOUT = 3, 15, 10


class FakeNvmlError(Exception):
    def __init__(self, value: int):
        super().__init__(f"NVML error {value}")
        self.value = value


def fake_pynvml(gpus: int = 2) -> types.ModuleType:
    """A pynvml module over `state`: per GPU counters, unsupported metrics, queued Xid events."""
    m = types.ModuleType("pynvml")
    state = SimpleNamespace(
        ecc=[0] * gpus,
        remap=[(0, 0, 0, 0)] * gpus,
        unsupported=set(),  # (gpu, metric name)
        lost=set(),
        events=[],  # (gpu, xid)
        registered=[],
    )

    def metric(name, value):
        def read(h, *args):
            if h in state.lost:
                raise FakeNvmlError(GPU_IS_LOST)
            if (h, name) in state.unsupported:
                raise FakeNvmlError(NOT_SUPPORTED)
            return value(h)

        return read

    def wait(event_set, timeout_ms):
        assert timeout_ms == 0  # a read never blocks
        if not state.events:
            raise FakeNvmlError(TIMEOUT)
        gpu, xid = state.events.pop(0)
        return SimpleNamespace(device=gpu, eventData=xid)

    m.NVMLError = FakeNvmlError
    m.NVML_ERROR_GPU_IS_LOST = GPU_IS_LOST
    m.NVML_TEMPERATURE_GPU = 0
    m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    m.NVML_VOLATILE_ECC = 0
    m.nvmlEventTypeXidCriticalError = 8
    m.nvmlInit = lambda: None
    m.nvmlDeviceGetCount = lambda: gpus
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetIndex = lambda h: h
    m.nvmlEventSetCreate = lambda: "event-set"
    m.nvmlDeviceRegisterEvents = lambda h, kind, s: state.registered.append((h, kind))
    m.nvmlEventSetWait_v2 = wait
    m.nvmlDeviceGetUtilizationRates = metric("util", lambda h: SimpleNamespace(gpu=50))
    m.nvmlDeviceGetMemoryInfo = metric("memory", lambda h: SimpleNamespace(used=1 << 30))
    m.nvmlDeviceGetTemperature = metric("temperature", lambda h: 60)
    m.nvmlDeviceGetCurrentClocksThrottleReasons = metric("throttle", lambda h: 0)
    m.nvmlDeviceGetTotalEccErrors = metric("ecc", lambda h: state.ecc[h])
    m.nvmlDeviceGetRemappedRows = metric("remap", lambda h: state.remap[h])
    m.state = state
    return m


@pytest.fixture
def nvml(monkeypatch):
    module = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    reader = Nvml()
    assert reader.available and module.state.registered == [(0, 8), (1, 8)]
    return reader, module.state


def types_of(found):
    return [(t, hw) for t, _, hw in found]


def test_a_healthy_gpu_and_an_unsupported_metric_are_no_fault(nvml):
    reader, state = nvml
    before = reader.read()
    state.unsupported |= {(0, "ecc"), (0, "remap"), (1, "temperature")}  # no ECC on a card, say
    now = reader.read()
    assert now[0]["ecc_uncorrected"] is None and now[1]["temperature"] is None
    assert gpu_problems(before, now) == [] and gpu_problems(now, reader.read()) == []


def test_nvml_xid_events_are_judged_by_their_number(nvml):
    reader, state = nvml
    before = reader.read()
    state.events += [(1, 13), (0, 79), (1, 31)]
    now = reader.read()
    assert (now[0]["xid"], now[0]["xid_codes"], now[1]["xid"]) == (1, [79], 2)
    assert types_of(gpu_problems(before, now)) == [
        (anomaly_types.XID, True),
        (anomaly_types.XID_APP, False),
        (anomaly_types.XID_APP, False),
    ]
    assert gpu_problems(now, reader.read()) == []  # each event is reported once


def test_ecc_counters_and_the_row_remapper_are_hardware(nvml):
    reader, state = nvml
    before = reader.read()
    state.ecc[0] = 2
    state.remap[1] = (0, 1, 1, 1)  # one uncorrectable row, pending, remapping failed
    found = gpu_problems(before, reader.read())
    assert types_of(found) == [(anomaly_types.ECC, True)] * 3
    assert "row remapping failed" in found[2][1]


def test_only_nvmls_gpu_is_lost_makes_a_gpu_lost(nvml):
    reader, state = nvml
    before = reader.read()
    state.lost.add(1)
    now = reader.read()
    assert "lost" in now[1] and types_of(gpu_problems(before, now)) == [
        (anomaly_types.GPU_LOST, True)
    ]


def test_the_log_scanner_classifies_whole_new_lines_only(tmp_path):
    log = tmp_path / "rank0.log"
    log.write_text("step 1 loss 2.0\n0 ECC errors\nxid 42 column\nNVRM: Xid (PCI:0000:3b:00): 7")
    scanner = LogScanner()
    assert scanner.poll({0: log}) == []  # the Xid line is not finished yet
    with open(log, "a") as f:
        f.write("9, pid=1, GPU has fallen off the bus.\nstep 2 loss 1.9\n")
    ((rank, found, line),) = scanner.poll({0: log})
    assert (rank, found.type, found.hardware, found.xid) == (0, anomaly_types.XID, True, 79)
    assert line.startswith("NVRM: Xid") and scanner.poll({0: log}) == []
