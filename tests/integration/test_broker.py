"""The embedded broker against a real JVM: readiness, records, topics, shutdown."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient

from rollstream.config import KafkaConfig
from rollstream.exceptions import TopicPartitionsMismatch
from rollstream.kafka.admin import check_copartitioned, create_topics, metadata_ready, topic_partitions
from rollstream.kafka.broker import EmbeddedBroker, daemon_status, start_daemon, stop_daemon
from rollstream.kafka.clients import make_producer
from rollstream.kafka.topics import Topics

pytestmark = pytest.mark.integration


def _gone(pid: int) -> bool:
    """True once ``pid`` no longer exists (a zombie still counts as present)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _names(n: int = 2) -> list[str]:
    prefix = f"t-{uuid.uuid4().hex[:8]}."
    return [f"{prefix}{i}" for i in range(n)]


def test_fixture_broker_answers_metadata(kafka_broker):
    assert metadata_ready(kafka_broker)


def test_produce_consume_round_trip(kafka_broker, topic_factory):
    topic = topic_factory(["prompts"]).prompts
    producer = KafkaProducer(bootstrap_servers=kafka_broker)
    producer.send(topic, key=b"k1", value=b"hello").get(timeout=30)
    producer.close()

    # No group: assign + seek avoids a group join; stop as soon as the record is in.
    consumer = KafkaConsumer(bootstrap_servers=kafka_broker, consumer_timeout_ms=10_000)
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    record = next(consumer)
    consumer.close()
    assert (record.key, record.value, record.offset) == (b"k1", b"hello", 0)


def test_topic_factory_creates_all_topics_with_rlvr_partitions(kafka_broker, topic_factory):
    topics = topic_factory(partitions=3)
    counts = topic_partitions(kafka_broker, list(topics.all(3)))
    assert counts == {name: p for name, (p, _) in topics.all(3).items()}
    assert counts[topics.responses] == 3 and counts[topics.prompts] == 1


def test_create_topics_is_idempotent_and_compacts(kafka_broker):
    plain, compacted = _names()
    specs = {plain: (3, False), compacted: (1, True)}
    create_topics(kafka_broker, specs)
    create_topics(kafka_broker, specs)  # second call: no error, nothing changes
    assert topic_partitions(kafka_broker, [plain, compacted]) == {plain: 3, compacted: 1}

    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    try:
        res = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, t)
                                      for t in (plain, compacted)])["topic"]
    finally:
        admin.close()
    assert res[compacted]["cleanup.policy"]["value"] == "compact"
    assert "cleanup.policy" not in res[plain]  # left at the broker default (delete)


def test_payload_topics_get_their_size_compression_and_retention_also_when_they_exist(kafka_broker):
    topics = Topics(f"t-{uuid.uuid4().hex[:8]}.")
    create_topics(kafka_broker, {topics.responses: (2, False)})  # an older run's topic: broker defaults
    kafka = KafkaConfig(max_message_bytes=8 * 1024 * 1024, compression_type="zstd", payload_retention_ms=86_400_000)
    create_topics(kafka_broker, topics.all(2), configs=topics.topic_configs(kafka))
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker)
    try:
        res = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, t)
                                      for t in (topics.responses, topics.trajectories, topics.groups_accepted)])["topic"]
    finally:
        admin.close()
    for payload in (topics.responses, topics.trajectories):
        assert {k: res[payload][k]["value"] for k in ("max.message.bytes", "compression.type", "retention.ms")} == {
            "max.message.bytes": "8388608", "compression.type": "zstd", "retention.ms": "-1"}  # the trainer deletes
    assert "max.message.bytes" not in res[topics.groups_accepted]  # decision topics keep the defaults
    assert topics.payload() == [topics.responses, topics.trajectories]


def test_check_copartitioned(kafka_broker):
    a, b, c = _names(3)
    create_topics(kafka_broker, {a: (2, False), b: (2, False), c: (3, False)})
    assert check_copartitioned(kafka_broker, [a, b]) == 2
    with pytest.raises(TopicPartitionsMismatch, match=c):
        check_copartitioned(kafka_broker, [a, b, c])
    with pytest.raises(TopicPartitionsMismatch, match="missing"):
        check_copartitioned(kafka_broker, [a, f"{a}-absent"])


def test_second_broker_runs_concurrently(kafka_broker, tmp_path):
    second = EmbeddedBroker(tmp_path / "second")
    try:
        bootstrap = second.start()
        assert bootstrap != kafka_broker
        assert second.port != second.controller_port
        assert metadata_ready(bootstrap) and metadata_ready(kafka_broker)
    finally:
        second.stop()
    assert metadata_ready(kafka_broker)  # stopping one leaves the other alone


def test_stop_leaves_no_java_process(tmp_path):
    broker = EmbeddedBroker(tmp_path / "b")
    broker.start()
    pid = broker.pid
    assert broker.is_running() and not _gone(pid)
    broker.stop()
    assert not broker.is_running()
    assert _gone(pid)
    assert not Path(f"/proc/{pid}").exists()


def test_daemon_start_status_stop(tmp_path):
    data_dir = tmp_path / "daemon"
    try:
        state = start_daemon(data_dir)
        assert (data_dir / "broker.json").exists()
        assert start_daemon(data_dir) == state  # already running: same broker back
        status = daemon_status(data_dir)
        assert status is not None and status["ready"] and status["pid"] == state["pid"]
    finally:
        assert stop_daemon(data_dir)
    assert daemon_status(data_dir) is None
    assert _gone(state["pid"])


@pytest.mark.parametrize("kwargs, batch_size", [
    ({}, 16384),  # kafka-python's default
    ({"batch_size": 1 << 20}, 1 << 20),  # a bulk loader's (the benchmarks' sources)
    ({"batch_size": 4 << 20, "max_request_size": 2 << 20}, 2 << 20),  # never above one request
])
def test_a_producer_batch_is_the_callers_size_capped_at_the_request_limit(kafka_broker, kwargs, batch_size):
    producer = make_producer(kafka_broker, **kwargs)
    try:
        assert producer.config["batch_size"] == batch_size
    finally:
        producer.close()


def test_topics_are_created_from_a_thread_that_runs_an_event_loop(kafka_broker):
    """A notebook or an async application calls in with its loop running, where asyncio.run
    refuses; the per-broker readiness check then runs in a thread of its own."""
    import asyncio

    name = f"t-{uuid.uuid4().hex[:8]}.in-loop"

    async def app() -> None:
        create_topics(kafka_broker, {name: (2, False)})

    asyncio.run(app())
    assert topic_partitions(kafka_broker, [name]) == {name: 2}
