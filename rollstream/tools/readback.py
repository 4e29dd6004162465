"""Read a topic back from the beginning to its current end (no consumer group, nothing
committed): the run summary, tests and debugging tools derive their numbers from the durable
events rather than from in-process counters."""

from __future__ import annotations

from typing import Iterator

from kafka import TopicPartition

from rollstream.exceptions import TopicNotFound
from rollstream.kafka.clients import reader_consumer
from rollstream.kafka.cluster import Bootstrap
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
