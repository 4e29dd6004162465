"""Shared fixtures: one real Kafka broker per test session, isolated topics per test, and one
real vLLM server per test session for the tests that generate with it."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from rollstream.config import KafkaConfig
from rollstream.exceptions import ConfigError
from rollstream.kafka.admin import create_topics
from rollstream.kafka.broker import SASL_ADMIN_USER, EmbeddedBroker, EmbeddedCluster
from rollstream.kafka.cluster import Cluster
from rollstream.kafka.topics import TOPICS, Topics
from rollstream.policy.model import model_folder
from rollstream.workers.local_server import PROJECT_ROOT, LocalInferenceServer, vllm_python


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


class _VLLMStarts:
    """What `_vllm_started_early` launched: the session's server, the in-process engine probe, or
    why neither could start (no vLLM environment)."""

    def __init__(self) -> None:
        self.server: LocalInferenceServer | None = None
        self.probe: subprocess.Popen | None = None
        self.probe_out: Path | None = None
        self.error: ConfigError | None = None


@pytest.fixture(scope="session", autouse=True)
def _vllm_started_early(request, tmp_path_factory) -> _VLLMStarts:
    """vLLM takes one to two minutes to start on 2 cores (its API server, engine core and worker
    are three processes that each import torch and vLLM) and then idles at ~0% CPU. When a selected
    test needs the session's server or the in-process probe, both are launched here, before the
    session's first test, so their start-up overlaps the tests that run before them."""
    needed = {name for item in request.session.items for name in item.fixturenames}
    starts = _VLLMStarts()
    if needed & {"vllm_server", "vllm_inprocess_probe"}:
        try:
            python = vllm_python()
        except ConfigError as e:
            starts.error = e
            needed = set()
    if "vllm_server" in needed:
        starts.server = LocalInferenceServer(model_folder(None), tmp_path_factory.mktemp("vllm") / "server.log",
                                             python=python, dtype="bfloat16", max_model_len=1024)
        starts.server.launch()
    if "vllm_inprocess_probe" in needed:
        folder = tmp_path_factory.mktemp("vllm-inprocess")
        starts.probe_out = folder / "probe.log"
        env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONWARNINGS": "ignore"}
        with open(starts.probe_out, "wb") as out:
            starts.probe = subprocess.Popen([python, str(PROJECT_ROOT / "tests" / "workers" / "vllm_inprocess_probe.py"),
                                             str(folder / "v1")], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield starts
    finally:
        if starts.server is not None:
            starts.server.stop(timeout_s=5)
        if starts.probe is not None and starts.probe.poll() is None:
            starts.probe.kill()
            starts.probe.wait()


@pytest.fixture(scope="session")
def vllm_server(_vllm_started_early) -> LocalInferenceServer:
    """A vLLM server (the .venv-vllm interpreter, `make vllm-env`) serving the bundled model in
    bfloat16, as `rollstream run` starts one; its log is in the session's temporary folder."""
    if _vllm_started_early.error is not None:
        raise _vllm_started_early.error
    server = _vllm_started_early.server
    server.wait_ready(timeout_s=600)  # 1-2 min on 2 cores from the session's start
    return server


@pytest.fixture(scope="session")
def vllm_inprocess_probe(_vllm_started_early) -> dict:
    """What tests/workers/vllm_inprocess_probe.py printed (its RESULT line, as a dict): the
    in-process VLLMBackend's greedy probe before and after loading perturbed weights in place."""
    if _vllm_started_early.error is not None:
        raise _vllm_started_early.error
    code = _vllm_started_early.probe.wait(timeout=900)
    output = _vllm_started_early.probe_out.read_text(errors="replace")
    assert code == 0, output[-3000:]
    [line] = [line for line in output.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


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
