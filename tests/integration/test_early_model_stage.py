"""A stage that holds a model loads it before it reaches Kafka: `rollstream run` starts it beside
the broker's start (the model's load is the longest start-up), and it serves once the broker
answers and the topics exist."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollstream.kafka.admin import create_pipeline_topics
from rollstream.kafka.broker import EmbeddedBroker, free_port
from rollstream.kafka.clients import make_producer
from rollstream.kafka.topics import Topics
from rollstream.config import load_config
from rollstream.schemas import encode
from rollstream.streams.event_builders import generation_request
from rollstream.tools.readback import read_values

from .harness import wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_generation_worker_loads_its_model_before_the_broker_exists_then_serves(tmp_path):
    raw = yaml.safe_load((ROOT / "examples" / "rlvr_math.yaml").read_text())
    raw["kafka"]["topic_prefix"] = "early."
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    config = load_config(config_path)
    broker = EmbeddedBroker(tmp_path / "kafka", port=free_port())
    log_path = tmp_path / "generation.log"
    with open(log_path, "wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "rollstream", "worker", "generation", "-c", str(config_path), "-b", broker.bootstrap],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "ROLLSTREAM_BROKER_WAIT_S": "120"})
    try:
        wait_for(lambda: "generation engine transformers loaded" in log_path.read_text() or worker.poll() is not None,
                 timeout=240, what="the generation engine's load")
        assert worker.poll() is None, log_path.read_text()
        assert not broker.is_running()  # loaded with no broker at all: it waits for one now
        broker.start()
        create_pipeline_topics(broker.cluster, config.kafka)
        topics = Topics(config.kafka.topic_prefix)
        request = generation_request({"prompt_id": "p0", "domain": "arithmetic", "prompt": "What is 2 + 3?",
                                      "ground_truth": "5"}, round_=0, num_return_sequences=2, sample_offset=0, seed=7)
        producer = make_producer(broker.cluster)
        producer.send(topics.generation_requests, key=b"p0", value=encode(request, "GenerationRequest"))
        producer.flush()
        producer.close()

        def responses() -> list[dict]:
            return [r for r in read_values(broker.cluster, topics.responses) if r.get("prompt_id") == "p0"]
        wait_for(lambda: len(responses()) == 2 or worker.poll() is not None, timeout=120, what="the responses of p0")
        written = responses()
        assert sorted(r["sample_index"] for r in written) == [0, 1], log_path.read_text()
        assert all(not r["error"] and len(r["response_token_ids"]) > 0 and r["policy_version"] == 0 for r in written)
    finally:
        worker.terminate()
        worker.wait(30)
        broker.stop()
