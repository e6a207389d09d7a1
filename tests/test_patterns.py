"""The log classifier on its corpora: harmless text is never a hardware error, real formats are.

tests/data/log_corpus/benign.txt and hardware.txt are written by generate.py next to them (seeded);
these tests also check the committed files are what the generator writes.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from transom.common import anomaly_types
from transom.monitor import patterns

CORPUS = Path(__file__).resolve().parent / "data" / "log_corpus"


def benign() -> list[str]:
    return (CORPUS / "benign.txt").read_text().splitlines()


def labelled() -> list[tuple[str, str]]:
    rows = (CORPUS / "hardware.txt").read_text().splitlines()
    return [(t, line) for t, line in (row.split("\t", 1) for row in rows)]


def test_the_committed_corpora_are_what_the_seeded_generator_writes():
    spec = importlib.util.spec_from_file_location("log_corpus_generate", CORPUS / "generate.py")
    assert spec is not None and spec.loader is not None
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    lines, rows = generate.corpora()
    assert benign() == lines and labelled() == rows


def test_the_corpora_are_big_and_varied_enough():
    lines = benign()
    assert len(set(lines)) >= 2000
    for word in ("error", "ECC", "xid", "Xid", "fallen", "timeout", "NCCL INFO", "Warning", "it/s"):
        assert sum(word in line for line in lines) >= 10, word
    rows = labelled()
    assert len(rows) >= 50
    hardware = [line for t, line in rows if t in anomaly_types.HARDWARE]
    assert len(hardware) >= 50 and {t for t, _ in rows} >= set(anomaly_types.HARDWARE)
    xids = {c.xid for line in hardware if (c := patterns.classify(line)) and c.xid is not None}
    assert len(xids) >= 10  # many Xid numbers, not one line repeated


def test_no_benign_line_is_classified_at_all_above_info():
    raised = [
        (c.type, line)
        for line in benign()
        if (c := patterns.classify(line)) is not None and c.severity != "info"
    ]
    assert raised == []


def test_every_hardware_corpus_line_gets_its_type():
    wrong = []
    for expected, line in labelled():
        c = patterns.classify(line)
        got = c.type if c is not None else None
        if got != expected or (
            c is not None and c.hardware != (expected in anomaly_types.HARDWARE)
        ):
            wrong.append((expected, got, line))
    assert wrong == []


@pytest.mark.parametrize(
    "line",
    [
        "0 ECC errors",
        "xid 42 column",
        "mlx5_core 0000:5e:00.0: no error",
        "uncorrectable ecc error encountered",  # not the CUDA runtime's text (case)
        "nvrm: xid (pci:0000:3b:00): 79, pid=1, gpu has fallen off the bus.",
        "GPU has fallen off the bus",  # the phrase without the driver's prefix
        "NVRM: Xid 79",  # no bus id, no comma: not the driver's format
        "nccl warn: something",
        "ProcessGroupNCCL initialization options: TIMEOUT(ms): 600000",
        "cublas returned CUBLAS_STATUS_SUCCESS",
    ],
)
def test_lookalikes_of_real_errors_are_not_classified(line):
    c = patterns.classify(line)
    assert c is None or (not c.hardware and c.severity == "info"), (line, c)


@pytest.mark.parametrize("xid", [48, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140, 149])
def test_hardware_xids_are_critical_hardware_with_their_number(xid):
    c = patterns.classify(f"[ 12.5] NVRM: Xid (PCI:0000:3b:00): {xid}, pid=77, name=python, x")
    assert c is not None and (c.type, c.severity, c.hardware, c.xid) == (
        anomaly_types.XID,
        "critical",
        True,
        xid,
    )


@pytest.mark.parametrize("xid,type_", [(13, anomaly_types.XID_APP), (31, anomaly_types.XID_APP),
                                       (43, anomaly_types.XID_APP), (8, anomaly_types.XID_OTHER),
                                       (154, anomaly_types.XID_OTHER)])  # fmt: skip
def test_application_and_other_xids_are_warnings_that_evict_nothing(xid, type_):
    for line in (
        f"NVRM: Xid (PCI:0000:9a:00): {xid}, pid=4242, name=python, Ch 00000010",
        f"Detected XID {xid} for GPU 2",
    ):
        c = patterns.classify(line)
        assert c is not None and (c.type, c.severity, c.hardware, c.xid) == (
            type_,
            "warning",
            False,
            xid,
        )
    assert type_ not in anomaly_types.HARDWARE


def test_the_catalogue_lists_are_disjoint_and_every_pattern_names_its_source():
    assert not patterns.HARDWARE_XIDS & patterns.APPLICATION_XIDS
    assert {13, 31, 43} <= patterns.APPLICATION_XIDS
    assert {48, 63, 64, 74, 79, 92, 94, 95, 119, 120} <= patterns.HARDWARE_XIDS
    assert all(p.source and not p.regex.flags & re.IGNORECASE for p in patterns.PATTERNS)


@pytest.mark.slow
def test_a_job_printing_harmless_error_lookalikes_is_never_evicted_or_restarted(start_job):
    """Both ranks print the whole benign corpus; a spare stands by, so an eviction could happen."""
    noisy = Path(__file__).resolve().parent / "scripts" / "noisy_prints.py"
    job = start_job("--nnodes", "2", "--spares", "1", noisy, "--steps", "20")
    assert job.wait() == 0, job.output
    log = job.log_text("g001/rank1.log")
    assert f"done rank=1 printed={len(benign())}" in log and "xid 42 column" in log
    noise = [
        e["message"]
        for e in job.events()
        if e["kind"] in ("anomaly", "warning", "decision", "incident", "evict", "rollback")
    ]
    assert noise == []
    status = job.status()["job"]
    assert status["generation"] == 1 and not status.get("evicted")
    assert status["state"] == "SUCCEEDED"
