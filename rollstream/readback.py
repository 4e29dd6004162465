"""Read a topic back from the beginning to its current end (no consumer group, nothing
committed): the run summary, tests and debugging tools derive their numbers from the durable
events rather than from in-process counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from kafka import KafkaConsumer, TopicPartition

from rollstream.exceptions import DecodeError
from rollstream.schemas import decode


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    schema: str | None  # None when undecodable
    value: dict | None
    raw: bytes


def read_topic(bootstrap: str, topic: str, timeout_s: float = 30.0) -> Iterator[Record]:
    """Every record of ``topic`` from offset 0 to the end offsets seen at call time."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None)
    try:
        partitions = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        if not tps:
            return
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        remaining = {tp for tp in tps if end[tp] > 0}
        idle_polls = 0
        while remaining and idle_polls < timeout_s * 5:
            polled = consumer.poll(timeout_ms=200)
            idle_polls = 0 if polled else idle_polls + 1
            for tp, msgs in polled.items():
                for m in msgs:
                    if m.offset >= end[tp]:
                        continue
                    try:
                        schema, value = decode(m.value)
                    except DecodeError:
                        schema, value = None, None
                    yield Record(m.topic, m.partition, m.offset, m.key, schema, value, m.value)
                if consumer.position(tp) >= end[tp]:
                    remaining.discard(tp)
    finally:
        consumer.close()


def read_values(bootstrap: str, topic: str) -> list[dict]:
    """Decoded values of every decodable record of ``topic``."""
    return [r.value for r in read_topic(bootstrap, topic) if r.value is not None]


def filter_decisions(accepted: list[dict], rejected: list[dict]) -> tuple[list[dict], int]:
    """Split the trainer's ``stale`` rejections of groups the filters had accepted (those groups
    are on both topics) from the filters' own rejections: (the filters' rejections, how many the
    trainer rejected)."""
    keys = {g["group_key"] for g in accepted}
    filters = [g for g in rejected if g["group_key"] not in keys]
    return filters, len(rejected) - len(filters)
