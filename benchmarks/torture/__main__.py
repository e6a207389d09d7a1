"""`python -m benchmarks.torture`: the torture suite (torture_suite.py)."""

import sys

from benchmarks.torture.torture_suite import main

sys.exit(main())
