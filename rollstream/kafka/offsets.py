"""Which offset a consumer may commit when records finish out of order.

Per partition, the committed offset is the lowest offset read but not yet done, or the next
offset to read when every record read is done. So a restart redelivers exactly the records
whose outputs may be missing, and never skips one. Pure bookkeeping: the caller reads, marks
records done once their outputs are acknowledged, and commits what ``to_commit()`` returns.
"""

from __future__ import annotations


class OffsetTracker:
    """Offsets read, pending and committed, per partition (offsets are Kafka offsets, ints)."""

    def __init__(self) -> None:
        self._pending: dict[int, set[int]] = {}  # partition -> offsets read and not yet done
        self._position: dict[int, int] = {}  # partition -> last offset read + 1
        self._committed: dict[int, int] = {}  # partition -> offset last committed

    def read(self, partition: int, offset: int, *, pending: bool = True) -> None:
        """Record that ``offset`` was read; ``pending=False`` for a record done at once (a
        duplicate, a dead letter written in the same flush)."""
        self._position[partition] = max(self._position.get(partition, 0), offset + 1)
        if pending:
            self._pending.setdefault(partition, set()).add(offset)

    def done(self, partition: int, offset: int) -> None:
        """The record's outputs are acknowledged: it need never be read again."""
        self._pending.get(partition, set()).discard(offset)

    def committable(self) -> dict[int, int]:
        """Partition -> the highest offset such that every record before it is done."""
        return {p: min(self._pending[p]) if self._pending.get(p) else pos for p, pos in self._position.items()}

    def to_commit(self) -> dict[int, int]:
        """The committable offsets that differ from what was last committed."""
        return {p: o for p, o in self.committable().items() if self._committed.get(p) != o}

    def committed(self, offsets: dict[int, int]) -> None:
        """Record offsets the broker accepted."""
        self._committed.update(offsets)
