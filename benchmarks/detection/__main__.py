"""`python -m benchmarks.detection`: the detection benchmark (detection_bench.py)."""

import sys

from benchmarks.detection.detection_bench import main

sys.exit(main())
