"""Read a topic back from the beginning to its current end (no consumer group, nothing
committed): the run summary, tests and debugging tools derive their numbers from the durable
events rather than from in-process counters."""

from __future__ import annotations

from typing import Iterator

from rollstream.exceptions import TopicNotFound
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
