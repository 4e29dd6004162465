"""The payload plane: events carrying token arrays are written once and read back by reference.

A ``PayloadRef`` (topic, partition, offset) names a ``Response`` on ``responses`` or a
``Trajectory`` on ``trajectories``. Decisions travel as small events that list references;
``PayloadFetcher`` resolves them for the trainer (accepted groups only) and the tools, with one
seek per run of wanted offsets, never reading a partition from the start. ``PayloadWriter``
writes payloads and returns their references, for sources that publish rewarded outcomes
themselves (synthetic sources, benchmarks, users' own generators).

A reference below its partition's log start offset (retention deleted the record) is expired:
the caller rejects the group ``payload_expired`` (docs/semantics.md, "Payloads and references").
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from kafka import KafkaConsumer, KafkaProducer
from kafka.errors import OffsetOutOfRangeError
from kafka.structs import TopicPartition

from rollstream.exceptions import RollstreamError
from rollstream.kafka.cluster import Bootstrap, as_cluster
from rollstream.runtime import PAYLOAD_MAX_MESSAGE_BYTES
from rollstream.schemas.records import payload_ref

log = logging.getLogger(__name__)

RefKey = tuple[str, int, int]
"""(topic, partition, offset) of a payload record."""


class PayloadFetchTimeout(RollstreamError):
    """Payload records that exist (between log start and end) did not arrive in time."""


def ref_key(ref: Mapping) -> RefKey:
    """The ``(topic, partition, offset)`` of a ``PayloadRef`` record."""
    return ref["topic"], int(ref["partition"]), int(ref["offset"])


@dataclass
class Fetched:
    """What one ``PayloadFetcher.fetch`` call found.

    ``values``: ref key -> the payload event's bytes. ``expired``: ref key -> why it cannot be
    read (below the log start offset, or at/after the log end offset)."""

    values: dict[RefKey, bytes] = field(default_factory=dict)
    expired: dict[RefKey, str] = field(default_factory=dict)


class PayloadFetcher:
    """Read payload events by reference with manual assignment and seeks (no consumer group).

    Args:
        bootstrap: the cluster (rollstream.kafka.cluster.Cluster) or its bootstrap servers.
        max_message_bytes: the largest payload event (``kafka.max_message_bytes``); fetch sizes
            are set to it.
        client_id: Kafka client id.

    Counters: ``fetched`` (payload records handed back), ``fetched_bytes``, ``skipped`` (records
    read on the way that no reference named), ``expired``.
    """

    def __init__(self, bootstrap: Bootstrap, max_message_bytes: int = PAYLOAD_MAX_MESSAGE_BYTES,
                 client_id: str = "rollstream-payloads") -> None:
        self.consumer = KafkaConsumer(
            **as_cluster(bootstrap).client_kwargs(), group_id=None, enable_auto_commit=False,
            auto_offset_reset="none", client_id=client_id,
            max_partition_fetch_bytes=max_message_bytes,
            fetch_max_bytes=max(52_428_800, max_message_bytes),
        )
        self.fetched = 0
        self.fetched_bytes = 0
        self.skipped = 0
        self.expired = 0

    def fetch(self, refs: Iterable[Mapping], timeout_s: float = 60.0) -> Fetched:
        """The bytes of every ``PayloadRef`` in ``refs`` that still exists; the others in
        ``expired`` with the reason. A reference named twice is read (and counted) once. Raises
        PayloadFetchTimeout when existing records are not read within ``timeout_s`` seconds (a
        broker that stopped answering)."""
        out = Fetched()
        wanted: dict[TopicPartition, set[int]] = {}
        for ref in refs:
            topic, partition, offset = ref_key(ref)
            wanted.setdefault(TopicPartition(topic, partition), set()).add(offset)
        if not wanted:
            return out
        remaining = {tp: sorted(offsets) for tp, offsets in wanted.items()}
        self._drop_unreadable(remaining, out)
        remaining = {tp: offsets for tp, offsets in remaining.items() if offsets}
        if not remaining:
            return out
        try:
            self._read(remaining, out, time.monotonic() + timeout_s, timeout_s)
        finally:
            self.consumer.assign([])  # fresh partition states (nothing paused) for the next fetch
        return out

    def _read(self, remaining: dict[TopicPartition, list[int]], out: Fetched, deadline: float,
              timeout_s: float) -> None:
        """Read the sorted offsets of ``remaining`` into ``out.values``: one seek per run of
        wanted offsets, the records between two runs skipped by a seek when they were not
        fetched already."""
        self.consumer.assign(list(remaining))
        for tp, offsets in remaining.items():
            self.consumer.seek(tp, offsets[0])
        while remaining:
            if time.monotonic() > deadline:
                missing = sum(len(v) for v in remaining.values())
                raise PayloadFetchTimeout(f"{missing} payload records not read within {timeout_s:.0f}s")
            try:
                polled = self.consumer.poll(timeout_ms=200, max_records=10_000)
            except OffsetOutOfRangeError:  # retention deleted records after the check above
                self._drop_unreadable(remaining, out)
                for tp in [tp for tp, offsets in remaining.items() if not offsets]:
                    del remaining[tp]
                    self.consumer.pause(tp)
                for tp, offsets in remaining.items():
                    self.consumer.seek(tp, offsets[0])
                continue
            for tp, records in polled.items():
                todo = remaining.get(tp)
                if todo is None:
                    continue
                want = set(todo)
                for record in records:
                    if record.offset in want:
                        out.values[(tp.topic, tp.partition, record.offset)] = record.value
                        want.discard(record.offset)
                        self.fetched += 1
                        self.fetched_bytes += len(record.value or b"")
                    else:
                        self.skipped += 1
                todo = sorted(want)
                if todo:
                    remaining[tp] = todo
                    if self.consumer.position(tp) != todo[0]:
                        self.consumer.seek(tp, todo[0])  # skip what no reference names
                else:
                    del remaining[tp]
                    self.consumer.pause(tp)

    def _drop_unreadable(self, wanted: dict[TopicPartition, list[int]], out: Fetched) -> None:
        """Move offsets outside [log start, log end) from ``wanted`` to ``out.expired``."""
        tps = list(wanted)
        starts = self.consumer.beginning_offsets(tps)
        ends = self.consumer.end_offsets(tps)
        for tp in tps:
            keep = []
            for offset in wanted[tp]:
                if offset < starts[tp]:
                    out.expired[(tp.topic, tp.partition, offset)] = (
                        f"{tp.topic}[{tp.partition}]@{offset} is below the log start offset {starts[tp]} "
                        "(deleted by retention)")
                elif offset >= ends[tp]:
                    out.expired[(tp.topic, tp.partition, offset)] = (
                        f"{tp.topic}[{tp.partition}]@{offset} is at or after the log end offset {ends[tp]}")
                else:
                    keep.append(offset)
            self.expired += len(wanted[tp]) - len(keep)
            wanted[tp] = keep

    def close(self) -> None:
        self.consumer.close()

    def __enter__(self) -> "PayloadFetcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PayloadWriter:
    """Write payload events and return their ``PayloadRef`` records (waits for the broker's
    acknowledgement, which carries the offset). ``producer``: a ``make_producer`` producer sized
    for ``kafka.max_message_bytes``."""

    def __init__(self, producer: KafkaProducer, timeout_s: float = 60.0) -> None:
        self.producer = producer
        self.timeout_s = timeout_s

    def write(self, items: Iterable[tuple[str, str, bytes]]) -> list[dict]:
        """Send every ``(topic, key, value)`` and return their references, in order. Raises
        kafka-python's errors (e.g. MessageSizeTooLargeError) when the broker refuses one."""
        pending = [(self.producer.send(topic, key=key.encode(), value=value), len(value))
                   for topic, key, value in items]
        refs = []
        for future, size in pending:
            meta = future.get(timeout=self.timeout_s)
            refs.append(payload_ref(meta.topic, meta.partition, meta.offset, size))
        return refs
