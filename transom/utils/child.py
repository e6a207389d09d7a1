"""`Child`: a process `transom run` started (a controller candidate or a node agent) and how.

It only starts the process (which dies with its parent, `procs.die_with_parent`) with its output
in its log file; the launcher decides when, and stops and reaps it. It must never restart a
process by itself.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from transom.utils.procs import die_with_parent


@dataclass
class Child:
    """A process this launcher started: a controller candidate or a node agent."""

    name: str
    kind: str  # "controller" | "agent" | "retired" (a controller stopped: its node no candidate)
    argv: list[str]
    log_path: Path
    process: subprocess.Popen | None = None
    node: str | None = None  # with --store: the node whose candidate this controller is
    restarts: int = 0  # a restarted controller's id is its first name with ".<restarts>"
    env: dict[str, str] | None = None  # variables added to the launcher's own

    def __post_init__(self) -> None:
        self.base = self.name

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env} if self.env else None,
                preexec_fn=die_with_parent,
            )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None
