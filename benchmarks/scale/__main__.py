"""`python -m benchmarks.scale`: the scale benchmark (main.py)."""

import sys

from benchmarks.scale.main import main

sys.exit(main())
