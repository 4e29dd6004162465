"""Reading topics back without a consumer group (nothing committed): the one place the stages and
tools re-read what is on a topic.

- ``read_partition`` and its uses, ``read_prompts``, ``read_outcomes_since``, ``read_history``: a
  single-partition topic up to an end offset (the admission re-reads its prompts for later epochs
  and validation rounds, its outcomes after a gap, its prompt history at start);
- ``count_records``, ``records_written``, ``first_record_ms``: a topic's size, what was ever
  written to it and its start, from its offsets alone;
- ``TopicTail``: several topics read on to their current ends again and again, each record once
  (a summary kept up to date during a run);
- ``Tail``: the events that arrived since the last call, without waiting (the trainer's verdicts).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator, TypeVar

from kafka import TopicPartition

from rollstream.exceptions import RollstreamError
from rollstream.kafka.clients import reader_consumer
from rollstream.kafka.cluster import Bootstrap
from rollstream.kafka.events import decode_expected
from rollstream.schemas import decode

T = TypeVar("T")


def read_partition(bootstrap: Bootstrap, topic: str, schemas: tuple[str, ...], end_offset: int | None = None,
                    since_ms: int | None = None, timeout_s: float = 60.0) -> list[tuple[str, dict]]:
    """``(schema, record)`` of the decodable, valid records of ``schemas`` on partition 0 of
    ``topic``, in topic order: from the earliest offset held (or the first written at
    ``since_ms``, epoch ms, or later) to ``end_offset`` (None: the end offset at the call).
    Raises TimeoutError when the broker does not deliver them within ``timeout_s``."""
    consumer = reader_consumer(bootstrap)
    tp = TopicPartition(topic, 0)
    try:
        consumer.assign([tp])
        end = consumer.end_offsets([tp])[tp] if end_offset is None else end_offset
        if since_ms is None:
            consumer.seek_to_beginning(tp)
        else:
            start = consumer.offsets_for_times({tp: max(0, since_ms)})[tp]
            if start is None:  # nothing written since then
                return []
            consumer.seek(tp, start.offset)
        out: list[tuple[str, dict]] = []
        deadline = time.monotonic() + timeout_s
        while consumer.position(tp) < end:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: read up to offset {consumer.position(tp)} of {end} in {timeout_s}s")
            for message in consumer.poll(timeout_ms=500).get(tp, []):
                if message.offset >= end:
                    break
                schema, record, problem = decode_expected(message.value, schemas)
                if problem is None:
                    out.append((schema, record))
        return out
    finally:
        consumer.close()


def read_prompts(bootstrap: Bootstrap, topic: str, end_offset: int | None, domains: set[str], mode: str = "train",
                 timeout_s: float = 60.0) -> list[dict]:
    """The Prompt records of ``mode`` and ``domains`` at offsets below ``end_offset`` (None: the
    end offset at the call) on ``topic``, in topic order: what each later epoch re-reads (train)
    and each validation round admits again (val). Undecodable or malformed events, unknown
    domains and repeated ids were never admitted and are skipped."""
    out: list[dict] = []
    seen: set[str] = set()  # a repeated id was dead-lettered as a duplicate: admitted once
    for schema, record in read_partition(bootstrap, topic, ("Prompt", "PromptsEnd"), end_offset, timeout_s=timeout_s):
        if (schema == "Prompt" and record.get("mode", "train") == mode and record["domain"] in domains
                and record["prompt_id"] not in seen):
            seen.add(record["prompt_id"])
            out.append(record)
    return out


def read_outcomes_since(bootstrap: Bootstrap, topic: str, since_ms: int, timeout_s: float = 30.0) -> list[dict]:
    """The PromptOutcome records on ``topic`` written at ``since_ms`` (epoch ms) or later, up to
    the end offset at the call, in topic order (undecodable events skipped: the outcomes agent
    dead-letters them)."""
    return [r for _, r in read_partition(bootstrap, topic, ("PromptOutcome",), since_ms=since_ms, timeout_s=timeout_s)]


def read_history(bootstrap: Bootstrap, topic: str, build: Callable[[dict], T], timeout_s: float = 60.0) -> dict[str, T]:
    """The newest PromptHistory of every prompt on the compacted ``topic``, as ``build`` makes it
    of the record (rollstream.filtering.history.PromptHistory.from_record): prompt_id -> it."""
    return {r["prompt_id"]: build(r) for _, r in read_partition(bootstrap, topic, ("PromptHistory",), timeout_s=timeout_s)}


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


def records_written(bootstrap: Bootstrap, topic: str) -> int:
    """How many records were ever written to ``topic`` (its end offsets, summed; 0 when it does
    not exist): records since deleted (a payload topic the trainer prunes) included."""
    consumer = reader_consumer(bootstrap)
    try:
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            return 0
        return sum(consumer.end_offsets([TopicPartition(topic, p) for p in sorted(partitions)]).values())
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


def decoded(messages: Iterable) -> Iterator[tuple[str, dict]]:
    """``(schema, value)`` of each consumer record in ``messages`` that decodes; tombstones and
    undecodable events are skipped (their stages dead-letter them)."""
    for message in messages:
        if message.value is None:
            continue
        try:
            schema, value = decode(message.value)
        except RollstreamError:
            continue
        if value is not None:
            yield schema, value


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
        keep = self.keep.get(topic)
        self._values[topic] += [value for _, value in decoded(messages) if keep is None or keep(value)]

    def close(self) -> None:
        self._consumer.close()


class Tail:
    """Reads a topic from its start without a consumer group; ``new()`` returns the decodable
    ``(schema, record)`` events that arrived since the last call, without waiting (the trainer's
    verdicts, rollstream.trainer.verdicts)."""

    def __init__(self, bootstrap: Bootstrap, topic: str) -> None:
        self.consumer = reader_consumer(bootstrap, topic)

    def new(self) -> list[tuple[str, dict]]:
        return [event for messages in self.consumer.poll(timeout_ms=0).values() for event in decoded(messages)]

    def close(self) -> None:
        self.consumer.close()
