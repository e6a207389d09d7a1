"""The monitor's overhead: blocks.py (inside one process, `python -m benchmarks.monitor.blocks`)
and overhead.py (process against process, `python -m benchmarks.monitor.overhead`)."""
