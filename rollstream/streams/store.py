"""A stateful stage's table as its processor sees it, without faust.

Reads go by key. Every write names the input partition its key belongs to (a table's changelog
is co-partitioned with the stage's input), so the same write is valid while an event of that
partition is handled and from the stage's timer, between events. faust's own ``table[key] = v``
cannot do the second: it takes the partition from the event being handled.
``streams.common.TableStore`` is the faust table behind this interface; :class:`MemoryStore` is
the one of tests, benchmarks and replays.
"""

from __future__ import annotations

from typing import Iterable, Protocol


class Store(Protocol):
    """Keys and values are bytes; ``put(partition, key, None)`` deletes ``key``."""

    def get(self, key: bytes) -> bytes | None: ...

    def items(self) -> Iterable[tuple[bytes, bytes]]: ...

    def put(self, partition: int, key: bytes, value: bytes | None) -> None: ...

    def flush(self) -> int:
        """Write what the store holds back; returns the keys written (a plain store holds
        nothing back: 0)."""
        ...


class MemoryStore(dict):
    """A :class:`Store` in a dict (key -> value; the partitions a write names are not kept)."""

    def put(self, partition: int, key: bytes, value: bytes | None) -> None:
        if value is None:
            self.pop(key, None)
        else:
            self[key] = value

    def flush(self) -> int:
        return 0


class HeldWrites:
    """A :class:`Store` in front of ``store`` that holds its writes until :meth:`flush`: a key
    written many times while a batch of events is handled is written to ``store`` once, with its
    last value (for a faust table: one changelog record instead of one per event). Reads see the
    held writes."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._held: dict[bytes, tuple[int, bytes | None]] = {}

    def get(self, key: bytes) -> bytes | None:
        held = self._held.get(key)
        return held[1] if held is not None else self.store.get(key)

    def items(self) -> list[tuple[bytes, bytes]]:
        """A snapshot: the caller may write while it iterates."""
        merged = dict(self.store.items())
        for key, (_, value) in self._held.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = value
        return list(merged.items())

    def put(self, partition: int, key: bytes, value: bytes | None) -> None:
        self._held.pop(key, None)  # a key keeps the position of its last write
        self._held[key] = (partition, value)

    def flush(self) -> int:
        """Write the held values to ``store`` in the order they were last written (a key written
        and deleted again while held, never in ``store``, is not written at all); returns how
        many keys were written."""
        held, self._held = self._held, {}
        written = 0
        for key, (partition, value) in held.items():
            if value is not None or self.store.get(key) is not None:
                self.store.put(partition, key, value)
                written += 1
        return written
