"""Training workloads shipped with Transom, so `transom demo` and the tests work from an install.

train_gpt.py is a plain training script (run it with python or torchrun, or `transom run`); its
data and model are in gpt_model.py, its checkpoints in gpt_checkpoints.py, its JSON result files
in results.py. examples/train_gpt.py is a thin wrapper that runs it. Importing this package must
never import torch.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def script_path(name: str = "train_gpt") -> Path:
    """The file of workload `name`, to run as a script (found without importing it)."""
    spec = importlib.util.find_spec(f"{__name__}.{name}")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"no workload {name!r} in {__name__}")
    return Path(spec.origin)
