"""HeldWrites: reads see the held writes; a flush writes each key once, its last value, in the
order of the last writes; a key written and deleted while held never reaches the store."""

from __future__ import annotations

from rollstream.streams.store import HeldWrites, MemoryStore


class LoggedStore(MemoryStore):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.log: list[tuple[int, bytes, bytes | None]] = []

    def put(self, partition: int, key: bytes, value: bytes | None) -> None:
        self.log.append((partition, key, value))
        super().put(partition, key, value)


def test_reads_see_held_writes_and_a_flush_writes_each_key_once():
    store = LoggedStore({b"a": b"1", b"b": b"2"})
    held = HeldWrites(store)
    held.put(0, b"a", b"10")
    held.put(1, b"c", b"3")
    held.put(0, b"a", b"11")
    held.put(0, b"b", None)
    assert (held.get(b"a"), held.get(b"b"), held.get(b"c"), held.get(b"z")) == (b"11", None, b"3", None)
    assert sorted(held.items()) == [(b"a", b"11"), (b"c", b"3")]
    assert store.log == [] and dict(store) == {b"a": b"1", b"b": b"2"}
    assert held.flush() == 3
    assert store.log == [(1, b"c", b"3"), (0, b"a", b"11"), (0, b"b", None)]
    assert dict(store) == {b"a": b"11", b"c": b"3"}
    assert held.flush() == 0 and len(store.log) == 3


def test_a_key_written_and_deleted_while_held_never_reaches_the_store():
    store = LoggedStore()
    held = HeldWrites(store)
    held.put(2, b"member", b"summary")
    held.put(2, b"member", None)
    assert held.get(b"member") is None and held.items() == []
    assert held.flush() == 0 and store.log == []
