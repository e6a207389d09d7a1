#!/usr/bin/env bash
# Set up, check lint, format and types, then run the test suite. Pass pytest options, e.g.
# `bash test.sh -m "not slow"` for the fast tests only.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
echo "ruff check, ruff format --check, mypy..." >&2
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
.venv/bin/mypy --no-error-summary
exec .venv/bin/python -m pytest -q "$@"
