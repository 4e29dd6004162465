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


class MemoryStore(dict):
    """A :class:`Store` in a dict (key -> value; the partitions a write names are not kept)."""

    def put(self, partition: int, key: bytes, value: bytes | None) -> None:
        if value is None:
            self.pop(key, None)
        else:
            self[key] = value
