#!/usr/bin/env bash
# Creates .venv and installs Transom with everything it needs (torch pinned to the CPU build
# on this machine's disk). Does nothing when the environment is already up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.transom-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
# Transom's own modules, byte-compiled (pip does so for a regular install, not for this editable
# one): where PYTHONDONTWRITEBYTECODE is set, as on this machine, every agent, checkpoint server
# and controller would compile them again as it starts (0.1-0.15 s of CPU each, a second of the
# demo's start-up). Quick when they are up to date.
byte_compile() { .venv/bin/python -m compileall -q -j 0 transom >/dev/null; }
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  byte_compile
  exit 0
fi
echo "setting up .venv (torch 2.13.0 CPU, etcd, test tools, transformers, lightning)..." >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 numpy
# The framework extras too (their tests run against the real packages); torch stays pinned.
.venv/bin/pip install -q --disable-pip-version-check -e '.[test,hf,lightning]' torch==2.13.0
byte_compile
echo "$want" > "$stamp"
