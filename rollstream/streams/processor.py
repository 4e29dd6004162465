"""The one shape of a stateful stream stage's work, without faust.

A processor owns a :class:`rollstream.streams.store.Store` (its table) and answers three calls:

- ``handle(topic, partition, value, now, offset=...)``: one input event's bytes, as read from
  ``topic`` at ``partition`` and ``offset``; returns what to send, and the dead-letter reason of an
  event it cannot use (bad input never raises);
- ``tick(partitions, now)``: the passing of time up to ``now`` (epoch ms) for the partitions this
  worker owns (deadlines, reissues);
- ``end_batch()``: the events handled since the last call form a batch: write what the processor
  held back to its store (each changed key once) and flush the store.

``assigned()`` says the worker's partitions may have changed (a rebalance): whatever the processor
keeps in memory beside its store (an index) is rebuilt from the store before its next tick.

An exception that is a :class:`rollstream.exceptions.StageFault` means the process cannot go on
(state held in memory is lost): the stage exits without acknowledging the batch and its restart
reprocesses it from the table. Any other exception from ``handle`` dead-letters that one event.

``streams.common.serve_processor`` runs a processor as a faust agent; tests, benchmarks and
replays call it directly over a ``MemoryStore``. The aggregator and the group queue have this
shape. Admission's processor (``admission_processor``) returns ``Handled`` too, from the calls its
agent makes one by one rather than from ``handle``/``tick``: it waits for credits before it takes
the next prompt and reads its own topics back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Protocol

from rollstream.kafka.events import Send


@dataclass
class Handled:
    """What handling an event or a tick produced."""

    sends: list[Send] = field(default_factory=list)
    error: tuple[str, str] | None = None  # (dead-letter reason, message) for an unusable event
    log: list[str] = field(default_factory=list)  # what an operator wants to see: decisions, reissues


class Processor(Protocol):
    def handle(self, topic: str, partition: int, value: bytes, now: int | None = None, *, offset: int) -> Handled: ...

    def tick(self, partitions: Collection[int], now: int | None = None) -> Handled: ...

    def end_batch(self) -> None: ...

    def assigned(self) -> None: ...
