"""The scale benchmark: the real controller against up to 1,024 simulated node agents.

scale_bench.py (`python -m benchmarks.scale`), agents.py (many simulated agents in one process,
run as `python -m benchmarks.scale.agents`), sharing.py (what one process's agents share)."""
