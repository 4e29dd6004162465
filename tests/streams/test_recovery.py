"""A restarted stage handles every event of its backlog.

faust resumes a stage's stream partitions, seeks them to the committed offsets and only then
resumes its flow, clearing the agents' queues. Events fetched while the seek awaited the broker
were cleared with them, past the fetch position: a restarted stage lost them (about one restart
in five on a backlog). The probe app (``recovery_probe``, built like every stage) prints the
state of the flow at each seek: stopped, every time, on a fresh start and on a start that
restores its table from the changelog."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from kafka import TopicPartition

from rollstream.kafka.admin import create_topics
from rollstream.kafka.clients import make_producer, reader_consumer

from ..integration.harness import wait_for

pytestmark = pytest.mark.integration

EVENTS_PER_START = 30


def echoed_offsets(bootstrap: str, topic: str) -> list[int]:
    consumer = reader_consumer(bootstrap)
    tp = TopicPartition(topic, 0)
    try:
        consumer.assign([tp])
        end = consumer.end_offsets([tp])[tp]
        consumer.seek_to_beginning(tp)
        out: list[int] = []
        while consumer.position(tp) < end:
            out += [int(m.value) for m in consumer.poll(timeout_ms=500).get(tp, [])]
        return out
    finally:
        consumer.close()


def test_a_restarted_stage_handles_every_event_of_its_backlog(kafka_broker: str, tmp_path: Path) -> None:
    prefix = f"t-{uuid.uuid4().hex[:8]}."
    create_topics(kafka_broker, {f"{prefix}in": (1, False), f"{prefix}out": (1, False)})
    producer = make_producer(kafka_broker)
    log_path = tmp_path / "probe.log"
    try:
        for start in range(2):  # a fresh table, then one restored from its changelog
            for i in range(EVENTS_PER_START):  # the backlog waits for the stage
                producer.send(f"{prefix}in", key=b"k", value=str(i).encode())
            producer.flush()
            sent = (start + 1) * EVENTS_PER_START
            with log_path.open("a") as log:
                probe = subprocess.Popen([sys.executable, "-m", "tests.streams.recovery_probe", kafka_broker, prefix],
                                         stdout=log, stderr=subprocess.STDOUT)
            try:
                wait_for(lambda: set(echoed_offsets(kafka_broker, f"{prefix}out")) >= set(range(sent)),
                         timeout=120, what=f"start {start}: every offset below {sent} handled")
            finally:
                probe.terminate()
                assert probe.wait(timeout=60) == 0
    finally:
        producer.close()
    seeks = re.findall(r"seek flow_control=(\w+) fetching=(\w+)", log_path.read_text())
    assert len(seeks) >= 2, log_path.read_text()  # at least one per start
    assert set(seeks) == {("False", "False")}
