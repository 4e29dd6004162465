"""The trainer's batch manifest: a JSON-lines file with one line per committed batch.

A line is appended (and fsynced) before the batch's offsets are committed, so after a crash its
group keys mark the redelivered groups as duplicates. A crash mid-write can leave a torn last
line: reading skips it, and the next append starts on a fresh line.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ManifestState:
    """What a manifest file holds, read at start.

    ``group_keys``: every line's keys in file order; ``last``: the entry of the highest step
    (the later line on a tie), None when there is none; ``committed_groups``: the sum of the
    lines' ``accepted_groups``.
    """

    group_keys: list[str] = field(default_factory=list)
    last: dict | None = None
    committed_groups: int = 0


class Manifest:
    """Read and append the manifest at ``path`` (created with its parent folders on first append)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def load(self) -> ManifestState:
        """Read every readable line; a missing file reads as empty. Unreadable (torn) lines are
        logged and skipped.

        Raises:
            KeyError: a readable line without ``step``.
        """
        keys: list[str] = []
        last: dict | None = None
        committed = 0
        for entry in self.entries():
            if last is None or entry["step"] >= last["step"]:
                last = entry
            keys.extend(entry.get("group_keys", []))
            committed += entry.get("accepted_groups", 0)
        return ManifestState(keys, last, committed)

    def entries(self) -> list[dict]:
        """Every readable line's entry, in file order (a missing file: none); an unreadable (torn)
        line is logged and skipped."""
        if not self.path.exists():
            return []
        out = []
        with self.path.open() as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:  # a torn last line from a crash mid-write
                    log.warning("ignoring unreadable line %d of %s", n, self.path)
        return out

    def append(self, entry: dict) -> None:
        """Append ``entry`` as one JSON line (sorted keys) and fsync it before returning.

        Raises:
            OSError: the file cannot be written.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a+b") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell() > 0:  # after a torn line from a crash, start on a fresh line
                fh.seek(-1, os.SEEK_END)
                torn = fh.read(1) != b"\n"
                fh.seek(0, os.SEEK_END)
                if torn:
                    fh.write(b"\n")
            fh.write((json.dumps(entry, sort_keys=True) + "\n").encode())
            fh.flush()
            os.fsync(fh.fileno())
