"""The goodput benchmark: one job and one fault schedule under Transom and under torchrun.

main.py (`python -m benchmarks.goodput`), common.py (constants and measures), torchrun.py (the
torchrun baseline)."""
