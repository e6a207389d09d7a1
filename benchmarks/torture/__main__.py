"""`python -m benchmarks.torture`: the torture suite (main.py)."""

import sys

from benchmarks.torture.main import main

sys.exit(main())
