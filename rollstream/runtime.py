"""The wall clock and the process identity every layer stamps on its events."""

from __future__ import annotations

import os
import socket
import time


def now_ms() -> int:
    """Wall-clock time in milliseconds since the epoch (event timestamps)."""
    return int(time.time() * 1000)


def worker_id(stage: str) -> str:
    """``<stage>-<host>-<pid>``: names a worker in its events, client ids and metrics."""
    return f"{stage}-{socket.gethostname()}-{os.getpid()}"
