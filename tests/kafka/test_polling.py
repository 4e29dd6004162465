"""ConsumerPoller against the real broker: records are read while the owner does nothing, stamped
when read; a pause stops the polls, so the positions are exactly past what was read; the poller
reads no further ahead than ``max_buffered``; an error of ``poll`` reaches the owner."""

from __future__ import annotations

import uuid

import pytest
from kafka import TopicPartition
from kafka.errors import KafkaConnectionError

from rollstream.kafka.clients import assigned_consumer, make_producer
from rollstream.kafka.polling import ConsumerPoller
from rollstream.runtime import now_ms
from tests.integration.harness import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def topic(kafka_broker, topic_factory):
    return topic_factory(["groups.accepted"]).groups_accepted


def produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    producer = make_producer(bootstrap)
    for value in values:
        producer.send(topic, value=value)
    producer.flush()
    producer.close()


def poller_of(bootstrap: str, topic: str, **kwargs) -> ConsumerPoller:
    consumer, _ = assigned_consumer(bootstrap, f"poll-{uuid.uuid4().hex[:8]}", topic, "poll-test", 500)
    return ConsumerPoller(consumer, "poll-test", kwargs.pop("max_records", 500), **kwargs)


def test_records_are_read_and_stamped_while_the_owner_is_away(kafka_broker, topic):
    poller = poller_of(kafka_broker, topic)
    try:
        sent = now_ms()
        produce(kafka_broker, topic, [b"a", b"b", b"c"])
        wait_for(lambda: poller.waiting == 3, timeout=30, interval=0.01, what="the poller reading 3 records")
        taken_at = now_ms()
        taken = poller.take(0.0)
        assert [r.value for r, _ in taken] == [b"a", b"b", b"c"]
        assert all(sent <= arrived <= taken_at for _, arrived in taken)
        assert poller.take(0.0) == [] and poller.waiting == 0
    finally:
        poller.close()
        poller.consumer.close()


def test_while_paused_nothing_is_polled_and_the_position_is_past_what_was_drained(kafka_broker, topic):
    poller = poller_of(kafka_broker, topic)
    tp = TopicPartition(topic, 0)
    try:
        produce(kafka_broker, topic, [b"a", b"b"])
        wait_for(lambda: poller.waiting == 2, timeout=30, interval=0.01, what="2 records read")
        with poller.paused() as consumer:
            produce(kafka_broker, topic, [b"c"])  # acknowledged by the broker: no poll reads it now
            assert [r.value for r, _ in poller.drain()] == [b"a", b"b"]
            assert consumer.position(tp) == 2 and poller.waiting == 0
        wait_for(lambda: poller.waiting == 1, timeout=30, interval=0.01, what="the record sent while paused")
        assert [r.offset for r, _ in poller.take(0.0)] == [2]
    finally:
        poller.close()
        poller.consumer.close()


def test_the_poller_reads_no_further_ahead_than_max_buffered(kafka_broker, topic):
    poller = poller_of(kafka_broker, topic, max_records=1, max_buffered=1)
    tp = TopicPartition(topic, 0)
    try:
        produce(kafka_broker, topic, [b"a", b"b", b"c"])
        for offset in range(3):
            wait_for(lambda: poller.waiting == 1, timeout=30, interval=0.01, what=f"record {offset} read")
            with poller.paused() as consumer:
                assert consumer.position(tp) == offset + 1  # one record ahead of the owner, no more
                assert [r.offset for r, _ in poller.drain()] == [offset]
    finally:
        poller.close()
        poller.consumer.close()


class _Unreachable:
    """A consumer whose poll fails as kafka-python's does when no broker answers."""

    def poll(self, timeout_ms: int, max_records: int):
        raise KafkaConnectionError("no broker answers")


def test_an_error_of_poll_is_raised_by_the_owners_next_take():
    poller = ConsumerPoller(_Unreachable(), "poll-test", 10)
    try:
        with pytest.raises(KafkaConnectionError, match="no broker answers"):
            poller.take(30.0)
    finally:
        poller.close()
