#!/usr/bin/env bash
# Set up, check lint, format and types, then run the tests.
#   bash test.sh               the unit and integration tiers (minutes)
#   bash test.sh --all         every test, the e2e tier's whole jobs included (over half an hour)
# Other options go to pytest after the tier choice, so they may narrow it or replace it:
#   bash test.sh -k checkpoint        bash test.sh --all -m e2e        bash test.sh tests/test_cli.py
# The tiers (unit, integration, e2e) and how a test gets one: docs/testing.md.
set -euo pipefail
cd "$(dirname "$0")"
# The unit and integration tiers run on 3 pytest-xdist workers (their tests wait more than they
# compute: 2 cores stay busy); --all runs every test one at a time, as the e2e tier's whole jobs
# need. `-n 0` (or another -n) after these options overrides the workers.
tiers=(-m "unit or integration" -n 3 --dist worksteal)
if [ "${1:-}" = "--all" ]; then
  tiers=()
  shift
fi
bash scripts/setup.sh
echo "ruff check, ruff format --check, mypy..." >&2
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
.venv/bin/mypy --no-error-summary
exec .venv/bin/python -m pytest -q --durations=10 "${tiers[@]}" "$@"
