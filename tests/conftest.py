"""Shared fixtures: one real Kafka broker per test session, isolated topics per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable

import pytest

from rollstream.config import KafkaConfig
from rollstream.kafka.admin import create_topics
from rollstream.kafka.broker import EmbeddedBroker
from rollstream.kafka.topics import TOPICS, Topics


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory) -> str:
    """Bootstrap string of a running broker: $ROLLSTREAM_TEST_BOOTSTRAP, or an embedded one."""
    external = os.environ.get("ROLLSTREAM_TEST_BOOTSTRAP")
    if external:
        yield external
        return
    broker = EmbeddedBroker(tmp_path_factory.mktemp("kafka"))
    bootstrap = broker.start(timeout=90)  # 2-core CI boxes can be slow on a cold JVM
    try:
        yield bootstrap
    finally:
        broker.stop()


@pytest.fixture
def topic_factory(kafka_broker) -> Callable[..., Topics]:
    """Return ``make(logical_names=None, partitions=1) -> Topics`` creating fresh topics.

    Each call uses a new ``t-<uuid8>.`` prefix, so tests never see each other's records.
    """

    def make(logical_names: list[str] | None = None, partitions: int = 1) -> Topics:
        topics = Topics(f"t-{uuid.uuid4().hex[:8]}.")
        wanted = {topics.name(n) for n in (logical_names or TOPICS)}
        specs = {k: v for k, v in topics.all(partitions).items() if k in wanted}
        create_topics(kafka_broker, specs, configs=topics.topic_configs(KafkaConfig()))
        return topics

    return make
