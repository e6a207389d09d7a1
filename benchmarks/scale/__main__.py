"""`python -m benchmarks.scale`: the scale benchmark (scale_bench.py)."""

import sys

from benchmarks.scale.scale_bench import main

sys.exit(main())
