"""`python -m benchmarks.goodput`: the goodput benchmark (goodput_bench.py)."""

import sys

from benchmarks.goodput.goodput_bench import main

sys.exit(main())
