"""What every layer shares at run time: the wall clock and process identity it stamps on its
events, the default topic prefix and payload size limit (a deployment's clients and its config
defaults agree)."""

from __future__ import annotations

import errno
import os
import socket
import time

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


def lower_cpu_priority(increment: int) -> None:
    """Add ``increment`` (0-19) to the nice value of every thread of this process, capped at 19.
    Linux keeps a nice value per thread, so ``os.nice`` alone would leave the threads already
    running (torch's OpenMP workers, started by a model load) at their old priority; threads
    started later inherit their creator's. A session leader also lowers its session's autogroup
    (``lower_session_priority``). Elsewhere: ``os.nice``."""
    if increment <= 0:
        return
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        os.nice(increment)
        return
    for tid in map(int, os.listdir(tasks)):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    lower_session_priority(increment)


AUTOGROUP_TRIES = 40  # 2 s of 50 ms waits for the kernel's rate limit (stages niced together)


def lower_session_priority(nice: int) -> None:
    """Set this session's autogroup nice to ``nice`` (0-19) when this process leads its session.

    With Linux's autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``, on by
    default in most distributions) the CPU is shared between sessions first and a thread's nice
    value counts only within its own session. `rollstream run` starts each stage and its vLLM
    server in a session of their own, so without this a niced generator still took half of two
    cores from the trainer beside it (each got one: a training step took twice as long). A process
    in a session it does not lead (a terminal's) leaves the session alone; without autogroup
    there is nothing to set."""
    if os.getsid(0) != os.getpid() or not os.path.exists("/proc/self/autogroup"):
        return
    for _ in range(AUTOGROUP_TRIES):
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(min(19, max(0, nice))))
            return
        except OSError as exc:  # EAGAIN: the kernel takes one unprivileged change per 100 ms, system-wide
            if exc.errno != errno.EAGAIN:
                return
            time.sleep(0.05)
