"""Monitor (the paper's TEE, "Eagle Eye"): multi-signal anomaly detection naming the node to blame.

Workers use `monitor.step`, `monitor.phase` and `monitor.report` (reporter.py); the node agent
collects and runs per-rank detectors (node.py, collect.py, patterns.py); the controller runs the
cross-node detectors (detectors.py) and exports metrics (exporter.py). Fault injection is in
transom.faults.
"""

from transom.monitor.reporter import phase, report, step

__all__ = ["phase", "report", "step"]
