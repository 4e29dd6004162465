"""Running a script the tests wait on, with a time limit it is stopped cleanly at."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

from rollstream.inference.local_server import PROJECT_ROOT


def run_script(command: list[str], log: Path, *, timeout_s: float, env: dict[str, str] | None = None,
               started: Callable[[subprocess.Popen], None] | None = None) -> int:
    """Run ``command`` from the project root, stdout and stderr to ``log``; its exit code.
    ``started`` gets the process once it runs (to stop it from another thread).

    Past ``timeout_s`` it gets SIGINT first, so a benchmark's ``finally`` blocks stop the workers
    and brokers it started, then SIGKILL to its whole session a minute later.

    Raises:
        TimeoutError: it was still running after ``timeout_s`` seconds (the message ends with the
            log's last 4,000 characters).
    """
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, env=env, cwd=PROJECT_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        if started is not None:
            started(proc)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise TimeoutError(f"still running after {timeout_s:.0f} s:\n{tail(log)}") from None
        finally:
            if proc.poll() is None:  # the test session is ending (KeyboardInterrupt, a stop)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else ""
