"""Anomaly type names: what the monitor calls each problem it finds, and which are hardware.

The detectors (transom.monitor) raise anomalies of these types, the policy answers them, and the
fault table (transom.faults) says which types detect each injected fault, so the report can
credit a detection. This module must never do I/O: it only names things.
"""

from __future__ import annotations

# -- raised by the monitor's detectors --------------------------------------------------------
CRASH = "crash"
HANG = "hang"
STRAGGLER = "straggler"
NAN = "nan"
SDC = "sdc"  # silent data corruption: replicas' parameters differ (transom.monitor.replicas)

# -- failure signatures in worker logs and GPU counters (transom/monitor/patterns.py) ---------
XID = "xid"  # an Xid that NVIDIA's catalogue ties to the hardware (patterns.HARDWARE_XIDS)
XID_APP = "xid_app"  # an Xid an application causes (out-of-range access, page fault): a warning
XID_OTHER = "xid_other"  # any other Xid (driver, informational): a warning
GPU_LOST = "gpu_lost"
ECC = "ecc"
IB_ERROR = "ib_error"
# Signatures of a bad node (evict it), not of the job or a peer.
HARDWARE = (XID, GPU_LOST, ECC, IB_ERROR)
