"""What every layer shares at run time: the wall clock and process identity it stamps on its
events, the default topic prefix and payload size limit (a deployment's clients and its config
defaults agree)."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")

DEFAULT_TOPIC_PREFIX = "rollstream."

PAYLOAD_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
"""Default ``kafka.max_message_bytes``: a 64k-token response is ~0.5 MiB of int32 ids and float32
logprobs, plus prompt tokens and text; 16 MiB leaves room for long agentic trajectories."""


def now_ms() -> int:
    """Wall-clock time in milliseconds since the epoch (event timestamps)."""
    return int(time.time() * 1000)


def worker_id(stage: str) -> str:
    """``<stage>-<host>-<pid>``: names a worker in its events, client ids and metrics."""
    return f"{stage}-{socket.gethostname()}-{os.getpid()}"


def at_low_priority(work: Callable[[], T], niceness: int = 10) -> T:
    """Run ``work()`` in a thread whose CPU priority is ``niceness`` below this thread's and
    return its result (its exception is raised here). For start-up work off the critical path: a
    trainer loads its model while the generation workers load theirs on the same cores, and the
    first generated token waits for those, not for the trainer. Linux lowers one thread's
    priority (the threads it starts inherit it; those of the caller do not); elsewhere ``work``
    runs at the caller's priority."""
    out: dict = {}

    def run() -> None:
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + niceness)
        except (AttributeError, OSError):  # no per-thread priority here: run as is
            pass
        try:
            out["result"] = work()
        except BaseException as exc:  # raised again in the caller
            out["error"] = exc

    thread = threading.Thread(target=run, name="low-priority", daemon=True)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["result"]
