"""One line per framework: callbacks and plugins for training loops that a framework owns.

The zero-code instrumentation (transom.monitor.auto) already gives every worker steps, step
times, heartbeats and the wait in collectives. What it cannot see needs the framework's help:

  hf.py         Hugging Face `Trainer`: `TransomCallback` (the Trainer's step numbers and the
                loss, so NaN/Inf and spikes are found at their step)
  lightning.py  Lightning: `TransomCallback` (the same) and `TransomCheckpointIO`, a
                `CheckpointIO` plugin that saves and loads through transom.checkpoint
  steps.py      the step report both callbacks make

Each framework module imports its framework at import time: install the extra
(`pip install transom[hf]`, `transom[lightning]`). Nothing here may raise into training: a
report that cannot be made is dropped, as in transom.monitor.
"""
