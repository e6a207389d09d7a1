"""`python -m benchmarks.detection`: the detection benchmark (main.py)."""

import sys

from benchmarks.detection.main import main

sys.exit(main())
