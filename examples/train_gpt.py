"""The example workload: runs transom/workloads/train_gpt.py (shipped inside the package).

    python examples/train_gpt.py --steps 20
    torchrun --nproc-per-node 3 examples/train_gpt.py --steps 50
    transom run --nnodes 3 examples/train_gpt.py --steps 200

It runs this checkout's copy when there is one, else the installed package's. See
transom/workloads/train_gpt.py for its options, determinism, checkpoints and output.
"""

import os
import runpy
import sys

CHECKOUT_COPY = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "transom",
    "workloads",
    "train_gpt.py",
)

if __name__ == "__main__":
    if os.path.isfile(CHECKOUT_COPY):
        script = CHECKOUT_COPY
    else:
        from transom.workloads import script_path

        script = str(script_path("train_gpt"))
    sys.argv[0] = script
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")
