"""Shared fixtures: one real Kafka broker per test session, isolated topics per test, real vLLM
servers for the tests that generate with them, and the work that starts in the background."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
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
from rollstream.inference.local_server import PROJECT_ROOT, LocalInferenceServer, vllm_python
from tests.processes import run_script, tail


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


# ---- work started in the background ------------------------------------------------------------
#
# Some tests wait minutes on work no test needs to watch: vLLM engines starting (a minute or two on
# 2 cores each: the API server, engine core and worker are three processes that each import torch
# and vLLM), and the benchmarks' --smoke runs. That work starts before the session's first test,
# in the background: the session's vLLM server at once (idle, it uses ~0% CPU), the rest one job at
# a time (two vLLM engines starting at once only slow each other and the tests), the spare server
# last. The tests that read its results run last, so the rest of the suite runs meanwhile. The
# suite alone keeps the two cores about 60% busy (its tests mostly wait on processes and the
# broker); the jobs run niced, so they take the idle share and not the running test's.


BACKGROUND_NICENESS = 10


def _reads_background(item) -> bool:
    return item.get_closest_marker("vllm") is not None or bool({"benchmark_smoke", "installed_wheel"}
                                                               & set(item.fixturenames))


def pytest_collection_modifyitems(items) -> None:
    """The tests that read background work (marked ``vllm``, or using ``benchmark_smoke`` or
    ``installed_wheel``) run last, in their order."""
    items.sort(key=_reads_background)


class _Jobs(threading.Thread):
    """Jobs (callables) run one after another in a thread; what each raised is kept for the test
    that reads it."""

    def __init__(self, folder: Path) -> None:
        super().__init__(name="background-jobs", daemon=True)
        self.folder = folder
        self.jobs: dict[str, Callable[[], object]] = {}
        self.errors: dict[str, str | None] = {}
        self.done: dict[str, threading.Event] = {}
        self.proc: subprocess.Popen | None = None
        self.stopped = False

    def call(self, name: str, fn: Callable[[], object]) -> None:
        self.jobs[name] = fn
        self.done[name] = threading.Event()

    def script(self, name: str, command: list[str], env: dict, timeout_s: float) -> None:
        """Run ``command`` in its turn, its output to ``<name>.log``; exit code 0 or it failed. It
        runs at a lower CPU priority (``nice``): it fills the cores the tests leave idle instead
        of slowing the test that runs meanwhile."""

        def run() -> None:
            code = run_script(["nice", "-n", str(BACKGROUND_NICENESS), *command], self.log(name),
                              timeout_s=timeout_s, env=env, started=self._track)
            if code != 0:
                raise RuntimeError(f"exit code {code}:\n{tail(self.log(name))}")

        self.call(name, run)

    def _track(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    def log(self, name: str) -> Path:
        return self.folder / f"{name}.log"

    def run(self) -> None:
        for name, fn in self.jobs.items():
            if self.stopped:
                self.errors[name] = "the session ended first"
            else:
                try:
                    fn()
                    self.errors[name] = None
                except Exception as exc:  # reported by output() to the test that needs it
                    self.errors[name] = f"{type(exc).__name__}: {exc}"
            self.done[name].set()

    def output(self, name: str) -> str:
        """``name``'s output (a script's log) once it succeeded; fails the test otherwise."""
        self.done[name].wait()
        assert self.errors[name] is None, f"{name}: {self.errors[name]}"
        return self.log(name).read_text(errors="replace") if self.log(name).exists() else ""

    def stop(self) -> None:
        self.stopped = True
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.join(timeout=30)


class _Background:
    """What `_background` started: the vLLM servers by fixture name, the jobs, and why the vLLM
    work could not start (no vLLM environment)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.servers: dict[str, LocalInferenceServer] = {}
        self.jobs = _Jobs(folder)
        self.vllm_error: ConfigError | None = None

    def vllm(self) -> "_Background":
        if self.vllm_error is not None:
            raise self.vllm_error
        return self


# vLLM servers by fixture: vllm_server starts with the session, vllm_spare_server after the other
# background jobs
_SERVERS = ("vllm_server", "vllm_spare_server")
# jobs under the vLLM environment's Python, by the fixture that returns their result
_VLLM_JOBS = {
    "vllm_inprocess_probe": lambda folder: [str(PROJECT_ROOT / "tests" / "inference" / "vllm_inprocess_probe.py"),
                                            str(folder / "v1")],
    "vllm_gpu_check": lambda folder: [str(PROJECT_ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--tiny",
                                      "--out", str(folder / "gpu-check.json")],
}


def _smoke_job(marker) -> str:
    """The job's name, which also names its log file: the marker's arguments, each reduced to
    letters, digits, dots and underscores (an argument may be a path)."""
    return "smoke-" + "-".join(re.sub(r"[^\w.]+", "_", a).strip("_") for a in marker.args)


@pytest.fixture(scope="session", autouse=True)
def _background(request, tmp_path_factory) -> _Background:
    """Starts, before the session's first test, the background work its selected tests need."""
    items = request.session.items
    needed = {name for item in items for name in item.fixturenames}
    smokes = {_smoke_job(m): m for item in items if "benchmark_smoke" in item.fixturenames
              for m in [item.get_closest_marker("benchmark_smoke")]}
    bg = _Background(tmp_path_factory.mktemp("background"))
    python = None
    if needed & {*_SERVERS, *_VLLM_JOBS}:
        try:
            python = vllm_python()
        except ConfigError as e:
            bg.vllm_error = e
    if python and "vllm_server" in needed:
        bg.servers["vllm_server"] = _local_server(python, tmp_path_factory)
        bg.servers["vllm_server"].launch()
    # in the order their tests read them (they run last, in file order)
    if smokes:
        bootstrap = request.getfixturevalue("kafka_broker")
        for name, marker in smokes.items():
            args = [a.format(kafka_broker=bootstrap) for a in marker.args[1:]]
            script = PROJECT_ROOT / "benchmarks" / f"{marker.args[0]}.py"
            bg.jobs.script(name, [sys.executable, str(script), "--smoke", "--out", str(bg.folder / f"{name}.json"), *args],
                        dict(os.environ), timeout_s=marker.kwargs.get("timeout", 600))
    if "installed_wheel" in needed:
        bg.jobs.script("installed_wheel", [sys.executable, "-m", "tests.packaging.wheel_probe", str(bg.folder / "wheel")],
                       dict(os.environ), timeout_s=900)
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONWARNINGS": "ignore"}
    for name, command in _VLLM_JOBS.items():
        if python and name in needed:
            bg.jobs.script(name, [python, *command(bg.folder)], env, timeout_s=900)
    if python and "vllm_spare_server" in needed:  # last: it is needed only at the end
        spare = bg.servers["vllm_spare_server"] = _local_server(python, tmp_path_factory)
        bg.jobs.call("vllm_spare_server", lambda: spare.start(timeout_s=600))
    bg.jobs.start()
    try:
        yield bg
    finally:
        bg.jobs.stop()
        for server in bg.servers.values():
            server.stop(timeout_s=5)


def _local_server(python: str, tmp_path_factory) -> LocalInferenceServer:
    return LocalInferenceServer(model_folder(None), tmp_path_factory.mktemp("vllm") / "server.log", python=python,
                                dtype="bfloat16", max_model_len=1024)


@pytest.fixture(scope="session")
def installed_wheel(_background) -> dict:
    """What tests/packaging/wheel_probe.py saw (its ``wheel.json``, plus its ``folder``): the
    wheel built, installed into a new environment and run, in the background."""
    _background.jobs.output("installed_wheel")
    folder = _background.folder / "wheel"
    return {**json.loads((folder / "wheel.json").read_text()), "folder": str(folder)}


@pytest.fixture(scope="session")
def vllm_server(_background) -> LocalInferenceServer:
    """A vLLM server (the .venv-vllm interpreter, `make vllm-env`) serving the bundled model in
    bfloat16, as `rollstream run` starts one; its log is in the session's temporary folder."""
    server = _background.vllm().servers["vllm_server"]
    server.wait_ready(timeout_s=600)  # 1-2 min on 2 cores from the session's start
    return server


@pytest.fixture(scope="session")
def vllm_spare_server(_background) -> LocalInferenceServer:
    """A second server like ``vllm_server``, for a test that kills one mid-run (it stays dead);
    started by the background jobs after the others."""
    _background.vllm().jobs.output("vllm_spare_server")
    return _background.servers["vllm_spare_server"]


@pytest.fixture(scope="session")
def vllm_inprocess_probe(_background) -> dict:
    """What tests/inference/vllm_inprocess_probe.py printed (its RESULT line, as a dict): the
    in-process VLLMBackend's greedy probe before and after loading perturbed weights in place."""
    output = _background.vllm().jobs.output("vllm_inprocess_probe")
    [line] = [line for line in output.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


@pytest.fixture(scope="session")
def vllm_gpu_check(_background) -> dict:
    """benchmarks/gpu_check.py's self-test (``--device cpu --tiny``) run by the vLLM environment's
    Python, so its vLLM section runs too: the JSON it wrote."""
    _background.vllm().jobs.output("vllm_gpu_check")
    return json.loads((_background.folder / "gpu-check.json").read_text())


@pytest.fixture
def benchmark_smoke(request, _background) -> dict:
    """The JSON of the test's ``@pytest.mark.benchmark_smoke(name, *args, timeout=s)`` run:
    ``benchmarks/<name>.py --smoke --out ... *args`` (``{kafka_broker}`` in an argument is the
    session's broker), run in the background; its ``smoke`` flag checked."""
    name = _smoke_job(request.node.get_closest_marker("benchmark_smoke"))
    _background.jobs.output(name)
    result = json.loads((_background.folder / f"{name}.json").read_text())
    assert result["smoke"] is True
    return result


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
    may kill and restart its nodes but must leave all three running.

    Three JVMs share two cores with the suite: under the default 9 s broker session a node
    starved that long is fenced while alive, and the tests that pause or list a node need the
    cluster to see what the test did, not what the load did."""
    cluster = EmbeddedCluster(tmp_path_factory.mktemp("kafka-cluster"), brokers=3,
                              properties={"broker.session.timeout.ms": "60000"})
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
