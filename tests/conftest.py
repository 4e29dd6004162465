"""Shared fixtures: one real Kafka broker per test session, isolated topics per test, and one
real vLLM server per test session for the tests that generate with it."""

from __future__ import annotations

import json
import os
import subprocess
import threading
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


def pytest_collection_modifyitems(items) -> None:
    """Tests marked ``vllm`` run last (in their order): what they need starts in the background at
    the session's first test (`_vllm_started_early`), so every other test runs while it starts."""
    items.sort(key=lambda item: item.get_closest_marker("vllm") is not None)


class _InOrder(threading.Thread):
    """Commands of the vLLM environment run one after another in the background, each one's
    output to a file: vLLM engines take a minute or more to start, and two starting at once only
    slow each other and the tests."""

    def __init__(self, commands: dict[str, list[str]], folder: Path, env: dict) -> None:
        super().__init__(name="vllm-jobs", daemon=True)
        self.commands, self.folder, self.env = commands, folder, env
        self.codes: dict[str, int] = {}
        self.done = {name: threading.Event() for name in commands}
        self.proc: subprocess.Popen | None = None
        self.stopped = False

    def run(self) -> None:
        for name, command in self.commands.items():
            if not self.stopped:
                with open(self.folder / f"{name}.log", "wb") as out:
                    self.proc = subprocess.Popen(command, env=self.env, stdout=out, stderr=subprocess.STDOUT)
                    self.codes[name] = self.proc.wait()
            self.done[name].set()

    def output(self, name: str, timeout_s: float) -> str:
        """``name``'s output once it exited 0; fails the test otherwise."""
        if not self.done[name].wait(timeout_s):
            pytest.fail(f"{name} still running after {timeout_s:.0f} s")
        output = (self.folder / f"{name}.log").read_text(errors="replace")
        assert self.codes.get(name) == 0, output[-3000:]
        return output

    def stop(self) -> None:
        self.stopped = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        self.join(timeout=30)


class _VLLMStarts:
    """What `_vllm_started_early` launched: the session's server, the in-process jobs, or why
    neither could start (no vLLM environment)."""

    def __init__(self) -> None:
        self.server: LocalInferenceServer | None = None
        self.jobs: _InOrder | None = None
        self.folder: Path | None = None
        self.error: ConfigError | None = None


# the in-process vLLM jobs, by the fixture that returns their result
_JOBS = {
    "vllm_inprocess_probe": lambda folder: [str(PROJECT_ROOT / "tests" / "workers" / "vllm_inprocess_probe.py"),
                                            str(folder / "v1")],
    "vllm_gpu_check": lambda folder: [str(PROJECT_ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--tiny",
                                      "--out", str(folder / "gpu-check.json")],
}


@pytest.fixture(scope="session", autouse=True)
def _vllm_started_early(request, tmp_path_factory) -> _VLLMStarts:
    """vLLM takes one to two minutes to start on 2 cores (its API server, engine core and worker
    are three processes that each import torch and vLLM) and then idles at ~0% CPU. When a selected
    test needs the session's server or an in-process vLLM job, they are launched here, before the
    session's first test, so their start-up overlaps the tests that run before them."""
    needed = {name for item in request.session.items for name in item.fixturenames}
    starts = _VLLMStarts()
    if needed & {"vllm_server", *_JOBS}:
        try:
            python = vllm_python()
        except ConfigError as e:
            starts.error = e
            needed = set()
    if "vllm_server" in needed:
        starts.server = LocalInferenceServer(model_folder(None), tmp_path_factory.mktemp("vllm") / "server.log",
                                             python=python, dtype="bfloat16", max_model_len=1024)
        starts.server.launch()
    jobs = [name for name in _JOBS if name in needed]
    if jobs:
        starts.folder = tmp_path_factory.mktemp("vllm-jobs")
        env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONWARNINGS": "ignore"}
        starts.jobs = _InOrder({name: [python, *_JOBS[name](starts.folder)] for name in jobs}, starts.folder, env)
        starts.jobs.start()
    try:
        yield starts
    finally:
        if starts.server is not None:
            starts.server.stop(timeout_s=5)
        if starts.jobs is not None:
            starts.jobs.stop()


def _started(starts: _VLLMStarts):
    if starts.error is not None:
        raise starts.error
    return starts


@pytest.fixture(scope="session")
def vllm_server(_vllm_started_early) -> LocalInferenceServer:
    """A vLLM server (the .venv-vllm interpreter, `make vllm-env`) serving the bundled model in
    bfloat16, as `rollstream run` starts one; its log is in the session's temporary folder."""
    server = _started(_vllm_started_early).server
    server.wait_ready(timeout_s=600)  # 1-2 min on 2 cores from the session's start
    return server


@pytest.fixture(scope="session")
def vllm_inprocess_probe(_vllm_started_early) -> dict:
    """What tests/workers/vllm_inprocess_probe.py printed (its RESULT line, as a dict): the
    in-process VLLMBackend's greedy probe before and after loading perturbed weights in place."""
    output = _started(_vllm_started_early).jobs.output("vllm_inprocess_probe", timeout_s=900)
    [line] = [line for line in output.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


@pytest.fixture(scope="session")
def vllm_gpu_check(_vllm_started_early) -> dict:
    """benchmarks/gpu_check.py's self-test (``--device cpu --tiny``) run by the vLLM environment's
    Python, so its vLLM section runs too: the JSON it wrote."""
    starts = _started(_vllm_started_early)
    starts.jobs.output("vllm_gpu_check", timeout_s=900)
    return json.loads((starts.folder / "gpu-check.json").read_text())


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
