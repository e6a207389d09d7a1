#!/usr/bin/env bash
# The main job: set up, then train the example GPT on 3 simulated nodes plus 1 hot spare.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
exec .venv/bin/transom run --nnodes 3 --spares 1 --nproc-per-node 1 examples/train_gpt.py --steps 200 "$@"
