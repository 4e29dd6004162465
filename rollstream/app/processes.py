"""Process supervision for `rollstream run`: one subprocess per stage, its log in a file, a check
that raises when one died, and a clean stop (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from rollstream.app.stages import Stage
from rollstream.exceptions import StageDied


class StageProcesses:
    """One subprocess per stage, logs under ``log_dir``; SIGTERM on close, then SIGKILL."""

    def __init__(self, config_path: Path, bootstrap, log_dir: Path) -> None:
        self.config_path, self.bootstrap, self.log_dir = config_path, bootstrap, log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, stage: Stage, *extra_args: str) -> str:
        """Start one process of ``stage`` (``extra_args`` appended to its command line, e.g.
        ``--instance 1 --instances 2``); returns its name (``aggregator``, ``aggregator-2``, ...),
        which also names its log file."""
        name, n = stage.value, 1
        while name in self.procs:
            n += 1
            name = f"{stage.value}-{n}"
        with open(self.log_dir / f"{name}.log", "wb") as log:  # the child keeps its own copy
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "rollstream", "worker", stage.value,
                 "--config", str(self.config_path), "--bootstrap", str(self.bootstrap), *extra_args],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        return name

    def check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                lines = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()
                tail = [line for line in lines if " INFO kafka." not in line][-30:]
                raise StageDied(f"stage {name} exited with {proc.returncode}; log tail:\n" + "\n".join(tail))

    def close(self, timeout: float = 15.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
