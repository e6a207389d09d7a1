#!/usr/bin/env bash
# The main job: set up, then run the fault-injection demo (`transom demo`): the example GPT on 4
# simulated nodes + 1 hot spare through a worker crash, a node death, a hang, a NaN and a slow
# node, a fault-free reference run, and the report in the run directory. Options go to the demo.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
exec .venv/bin/transom demo "$@"
