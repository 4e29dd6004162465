"""Read a topic back from the beginning to its current end (no consumer group, nothing
committed): the run summary, tests and debugging tools derive their numbers from the durable
events rather than from in-process counters."""

from __future__ import annotations

import time
from typing import Callable, Iterator

from kafka import TopicPartition

from rollstream.exceptions import DecodeError, TopicNotFound
from rollstream.kafka.clients import reader_consumer
from rollstream.kafka.cluster import Bootstrap
from rollstream.schemas import decode
from rollstream.tools.replay import Record, Selection, replay


def read_topic(bootstrap: Bootstrap, topic: str, timeout_s: float = 30.0) -> Iterator[Record]:
    """Every record of ``topic`` from offset 0 to the end offsets seen at call time (nothing
    when the topic does not exist); gives up after ``timeout_s`` without any record."""
    try:
        for item in replay(bootstrap, topic, Selection(), idle_timeout_s=timeout_s):
            yield item.record
    except TopicNotFound:
        return


def count_records(bootstrap: Bootstrap, topic: str) -> int:
    """How many records ``topic`` holds (end minus log start offset, summed over partitions; 0
    when it does not exist), from its offsets alone: no record is fetched, so it is how a payload
    topic is counted. Records deleted by retention are not counted; rollstream writes no
    transactions, so every offset is a record."""
    consumer = reader_consumer(bootstrap)
    try:
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            return 0
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        starts, ends = consumer.beginning_offsets(tps), consumer.end_offsets(tps)
        return sum(ends[tp] - starts[tp] for tp in tps)
    finally:
        consumer.close()


def first_record_ms(bootstrap: Bootstrap, topic: str) -> int | None:
    """The timestamp (epoch ms: the producer's clock) of the earliest record ``topic`` holds, over
    its partitions, from the broker's time index alone (no record is fetched); None when the topic
    is empty or does not exist."""
    consumer = reader_consumer(bootstrap)
    try:
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            return None
        found = consumer.offsets_for_times({TopicPartition(topic, p): 0 for p in sorted(partitions)})
        stamps = [f.timestamp for f in found.values() if f is not None]
        return min(stamps) if stamps else None
    finally:
        consumer.close()


def read_values(bootstrap: Bootstrap, topic: str) -> list[dict]:
    """Decoded values of every decodable record of ``topic``."""
    return [r.value for r in read_topic(bootstrap, topic) if r.value is not None]


def filter_decisions(accepted: list[dict], rejected: list[dict]) -> tuple[list[dict], int]:
    """Split the trainer's ``stale`` rejections of groups the filters had accepted (those groups
    are on both topics) from the filters' own rejections: (the filters' rejections, how many the
    trainer rejected)."""
    keys = {g["group_key"] for g in accepted}
    filters = [g for g in rejected if g["group_key"] not in keys]
    return filters, len(rejected) - len(filters)


class TopicTail:
    """``read_values`` of several topics, again and again, reading each record once: one
    consumer (no group, nothing committed) holds every topic asked for so far, and each
    ``values(topic)`` reads on to the end offsets of that moment. For a figure kept up to date
    during a run (rollstream.tools.summary.LiveSummary). Not thread-safe: one caller thread.

    Args:
        bootstrap: the cluster.
        keep: per topic, which decoded values to keep (all of a topic not named).
        timeout_s: ``values`` gives up after this long without any record (an end offset never
            reached) and returns what it has.
    """

    def __init__(self, bootstrap: Bootstrap, keep: dict[str, Callable[[dict], bool]] | None = None,
                 timeout_s: float = 30.0) -> None:
        self.keep = keep or {}
        self.timeout_s = timeout_s
        self._consumer = reader_consumer(bootstrap)
        self._values: dict[str, list[dict]] = {}

    def values(self, topic: str) -> list[dict]:
        """Every decodable value of ``topic`` kept so far, up to its end offsets at call time
        (the list grows with later calls; empty while the topic does not exist)."""
        consumer = self._consumer
        if topic not in self._values:
            partitions = consumer.partitions_for_topic(topic)
            if not partitions:
                return []
            new = [TopicPartition(topic, p) for p in sorted(partitions)]
            consumer.assign([*consumer.assignment(), *new])  # positions already held are kept
            consumer.seek_to_beginning(*new)
            self._values[topic] = []
        tps = [tp for tp in consumer.assignment() if tp.topic == topic]
        end = consumer.end_offsets(tps)
        idle_since = time.monotonic()
        while any(consumer.position(tp) < end[tp] for tp in tps):
            polled = consumer.poll(timeout_ms=200)
            if polled:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > self.timeout_s:
                break
            for tp, messages in polled.items():
                self._add(tp.topic, messages)
        return self._values[topic]

    def _add(self, topic: str, messages: list) -> None:
        keep, values = self.keep.get(topic), self._values[topic]
        for message in messages:
            if message.value is None:
                continue
            try:
                _, value = decode(message.value)
            except DecodeError:
                continue
            if value is not None and (keep is None or keep(value)):
                values.append(value)

    def close(self) -> None:
        self._consumer.close()
