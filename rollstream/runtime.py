"""What every layer shares at run time: the wall clock and process identity it stamps on its
events, and the default topic prefix (a deployment's topics and its config default agree)."""

from __future__ import annotations

import os
import socket
import time

DEFAULT_TOPIC_PREFIX = "rollstream."


def now_ms() -> int:
    """Wall-clock time in milliseconds since the epoch (event timestamps)."""
    return int(time.time() * 1000)


def worker_id(stage: str) -> str:
    """``<stage>-<host>-<pid>``: names a worker in its events, client ids and metrics."""
    return f"{stage}-{socket.gethostname()}-{os.getpid()}"
