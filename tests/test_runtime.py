"""Process helpers: the CPU priority a generator gives up reaches every thread it already runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CODE = """
import os, threading
from rollstream.runtime import lower_cpu_priority

started, done = threading.Event(), threading.Event()
tids = []

def wait():
    tids.append(threading.get_native_id())
    started.set()
    done.wait()

early = threading.Thread(target=wait)  # a thread running before (as torch's OpenMP workers)
early.start()
started.wait()
lower_cpu_priority(4)
print([os.getpriority(os.PRIO_PROCESS, t) for t in (threading.get_native_id(), *tids)])
lower_cpu_priority(30)  # capped at 19
started.clear()
late = threading.Thread(target=wait)  # started after: inherits
late.start()
started.wait()
print([os.getpriority(os.PRIO_PROCESS, t) for t in (threading.get_native_id(), *tids)])
done.set()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a nice value per thread is Linux's")
def test_lower_cpu_priority_reaches_the_threads_already_running_and_those_started_after():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[4, 4]", "[19, 19, 19]"]


AUTOGROUP = """
import os
from rollstream.runtime import lower_cpu_priority

lower_cpu_priority(10)
print(open("/proc/self/autogroup").read().strip())
"""


def autogroup_nice(line: str) -> str | None:
    """The nice in a ``/autogroup-<id> nice <n>`` line; None for the kernel's default group, which
    prints nothing (a session no process has left since boot, as a container's first one)."""
    return line.split()[-1] if line.strip() else None


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="a kernel with autogroup scheduling")
def test_a_session_leader_lowers_its_autogroup_and_a_process_in_another_session_leaves_it():
    """Under autogroup, nice values count only within a session: a stage `rollstream run` starts
    in a session of its own must lower the session's share, or it keeps half the cores."""
    led = subprocess.run([sys.executable, "-c", AUTOGROUP], capture_output=True, text=True, check=True,
                         start_new_session=True)
    assert autogroup_nice(led.stdout) == "10"
    ours = autogroup_nice(open("/proc/self/autogroup").read())  # the test's own session's nice
    inside = subprocess.run([sys.executable, "-c", AUTOGROUP], capture_output=True, text=True, check=True)
    assert autogroup_nice(inside.stdout) == ours  # not a session leader: the session stays as it was
