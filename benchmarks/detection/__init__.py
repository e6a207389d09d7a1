"""The detection benchmark: latency, attribution, precision and false positives of the monitor.

detection_bench.py (`python -m benchmarks.detection`), table.py (its table for people)."""
