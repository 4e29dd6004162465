"""The agentic benchmark's Kafka phase reports a producer that fails, at once, instead of
waiting out its safety timeout with the reason only on stderr."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def load_agentic():
    spec = importlib.util.spec_from_file_location("agentic_benchmark", ROOT / "benchmarks" / "agentic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def broken_events():
    yield b"k", b"v"
    raise RuntimeError("the workload broke")


def test_a_failing_producer_ends_the_timed_run_with_its_reason(kafka_broker, topic_factory, tmp_path):
    agentic = load_agentic()
    topics = topic_factory(partitions=agentic.PARTITIONS)
    raw = {**agentic.config_dict("bench.", 1, 8, 4, agentic.DEFAULT_FILTER),
           "kafka": {"topic_prefix": topics.prefix, "partitions": agentic.PARTITIONS}}
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # stands for the idle worker
    try:
        result = agentic._timed_run(kafka_broker, topics, raw, broken_events(), {"accepted": 1, "rejected": 0}, 8,
                                    worker, tmp_path, None)
    finally:
        worker.kill()
        worker.wait()
    assert result["kafka_error"] == "producing the trajectories failed: RuntimeError('the workload broke')"
    assert result["kafka_groups_decided"] == 0 and result["kafka_produce_s"] is None
