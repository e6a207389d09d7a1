#!/usr/bin/env bash
# Set up, then run the test suite. Pass pytest options, e.g. `bash test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
