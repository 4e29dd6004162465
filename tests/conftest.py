"""Shared fixtures: one real Kafka broker per test session, isolated topics per test, and one
real vLLM server per test session for the tests that generate with it."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable

import pytest

from rollstream.config import KafkaConfig
from rollstream.kafka.admin import create_topics
from rollstream.kafka.broker import SASL_ADMIN_USER, EmbeddedBroker, EmbeddedCluster
from rollstream.kafka.cluster import Cluster
from rollstream.kafka.topics import TOPICS, Topics
from rollstream.policy.model import model_folder
from rollstream.workers.local_server import LocalInferenceServer, vllm_python


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


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory) -> LocalInferenceServer:
    """A vLLM server (the .venv-vllm interpreter, `make vllm-env`) serving the bundled model in
    bfloat16, as `rollstream run` starts one; its log is in the session's temporary folder."""
    server = LocalInferenceServer(model_folder(None), tmp_path_factory.mktemp("vllm") / "server.log",
                                  python=vllm_python(), dtype="bfloat16", max_model_len=1024)
    server.start(timeout_s=600)  # ~60 s on 2 cores
    try:
        yield server
    finally:
        server.stop(timeout_s=5)


SASL_USER, SASL_PASSWORD = "alice", "alice-secret"


@pytest.fixture(scope="session")
def sasl_broker(tmp_path_factory) -> Cluster:
    """A single-node broker with SASL/SCRAM on its client port and the user SASL_USER
    (SASL_PASSWORD); returned as the Cluster of that user (SCRAM-SHA-256)."""
    broker = EmbeddedBroker(tmp_path_factory.mktemp("kafka-sasl"),
                            sasl_users={SASL_ADMIN_USER: "admin-secret", SASL_USER: SASL_PASSWORD})
    bootstrap = broker.start(timeout=90)
    try:
        yield Cluster(bootstrap, security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-256",
                      sasl_username=SASL_USER, sasl_password=SASL_PASSWORD)
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def kafka_cluster(tmp_path_factory) -> EmbeddedCluster:
    """A 3-node KRaft cluster on loopback (internal topics replicated 3 times, min ISR 2); tests
    may kill and restart its nodes but must leave all three running."""
    cluster = EmbeddedCluster(tmp_path_factory.mktemp("kafka-cluster"), brokers=3)
    cluster.start(timeout=180)
    try:
        yield cluster
    finally:
        cluster.stop()


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
