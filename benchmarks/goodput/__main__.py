"""`python -m benchmarks.goodput`: the goodput benchmark (main.py)."""

import sys

from benchmarks.goodput.main import main

sys.exit(main())
