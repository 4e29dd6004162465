"""A run's folder (``runs/<name>``) and the runs before it: starting a run never loses one.

A run that really started (its broker answered) carries a ``STARTED`` file holding its start
(UTC, ``%Y%m%d-%H%M%S``). When a new run of the same name begins, the folder there is:

* a start that never got going (an unreachable broker, a server that did not come up): it holds
  only what such a start writes (``FAILED_START``: its logs, config, stage pids, an empty broker
  folder) and is removed;
* anything else is a run (``STARTED``; or from before the file existed, or a trainer's
  ``rollstream worker trainer`` folder: a manifest, checkpoints, a summary): renamed
  ``<name>.<its start>`` and kept, or with ``replace`` deleted, but only once the new run has
  really started, so a start that fails keeps it either way.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

STARTED = ".started"
STAMP = "%Y%m%d-%H%M%S"
FAILED_START = frozenset({"logs", "kafka", "config.yaml", "stages.json", "stages.tmp"})
"""What a start that never got going leaves in its folder."""


def is_run(folder: Path) -> bool:
    """Whether ``folder`` holds a run (module doc): anything a failed start does not leave."""
    return (folder / STARTED).is_file() or any(p.name not in FAILED_START for p in folder.iterdir())


def make_room(run_dir: Path) -> Path | None:
    """Leave ``run_dir`` free for a new run without deleting a run (module doc). Returns the
    folder the previous run now lives in, or None when there was none."""
    if not run_dir.exists():
        return None
    if not is_run(run_dir):
        shutil.rmtree(run_dir)
        return None
    marker = run_dir / STARTED
    stamp = (marker.read_text().strip() if marker.is_file() else  # a run from before the marker: its last change
             time.strftime(STAMP, time.gmtime(max(p.stat().st_mtime for p in (run_dir, *run_dir.iterdir())))))
    kept, n = run_dir.with_name(f"{run_dir.name}.{stamp}"), 1
    while kept.exists():  # two runs started within a second
        n += 1
        kept = run_dir.with_name(f"{run_dir.name}.{stamp}-{n}")
    os.replace(run_dir, kept)
    return kept


def mark_started(run_dir: Path, previous: Path | None, replace: bool) -> None:
    """The run in ``run_dir`` really started: mark it a run, and delete the ``previous`` one
    (``make_room``'s) when asked to ``replace`` it."""
    (run_dir / STARTED).write_text(time.strftime(STAMP, time.gmtime()) + "\n")
    if replace and previous is not None:
        shutil.rmtree(previous, ignore_errors=True)
