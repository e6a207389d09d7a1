"""Monitor (the paper's TEE): what workers tell their node agent about their progress.

`from transom import monitor; monitor.report(step, loss=...)` is the worker-side API.
"""

from transom.monitor.reporter import report

__all__ = ["report"]
