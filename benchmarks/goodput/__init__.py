"""The goodput benchmark: one job and one fault schedule under Transom and under torchrun.

goodput_bench.py (`python -m benchmarks.goodput`), common.py (constants and measures),
torchrun.py (the torchrun baseline)."""
