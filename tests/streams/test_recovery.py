"""A restarted stage restores its table and handles every event of its backlog.

faust resumes a stage's stream partitions, seeks them to the committed offsets and only then
resumes its flow, clearing the agents' queues. Events fetched while the seek awaited the broker
were cleared with them, past the fetch position: a restarted stage lost them (about one restart
in five on a backlog). The probe app (``recovery_probe``, built like every stage) prints the
state of the flow at each seek: stopped, every time, on a fresh start and on a start that
restores its table from the changelog.

A fetch in flight when the stream partitions are resumed can also come back with their events
while the flow is stopped; faust drops them and seeks back to the committed offsets, which
moved nothing on a partition without one: a killed aggregator's successor lost its first
responses and the run stalled. The second start's backlog is on ``in2``, a partition nothing
was committed on, and ``slow-seek`` makes that interleaving certain."""

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


def echoes(bootstrap: str, topic: str) -> list[tuple[str, int, int]]:
    """(input topic, offset, values in the table before it) per echo, in order."""
    consumer = reader_consumer(bootstrap)
    tp = TopicPartition(topic, 0)
    try:
        consumer.assign([tp])
        end = consumer.end_offsets([tp])[tp]
        consumer.seek_to_beginning(tp)
        out: list[tuple[str, int, int]] = []
        while consumer.position(tp) < end:
            for m in consumer.poll(timeout_ms=500).get(tp, []):
                name, offset, seen = m.value.decode().split()
                out.append((name, int(offset), int(seen)))
        return out
    finally:
        consumer.close()


@pytest.mark.parametrize("options", [(), ("slow-seek",)], ids=["plain", "slow-seek"])
def test_a_restarted_stage_restores_its_table_and_handles_every_event_of_its_backlog(
        kafka_broker: str, tmp_path: Path, options: tuple[str, ...]) -> None:
    prefix = f"t-{uuid.uuid4().hex[:8]}."
    create_topics(kafka_broker, {f"{prefix}{name}": (1, False) for name in ("in", "in2", "out")})
    producer = make_producer(kafka_broker)
    log_path = tmp_path / "probe.log"
    expected: set[tuple[str, int]] = set()
    first_start_echoes = 0
    try:
        for start, topic in enumerate(("in", "in2")):  # a fresh table, then one restored from its changelog
            for i in range(EVENTS_PER_START):  # the backlog waits for the stage
                producer.send(f"{prefix}{topic}", key=b"k", value=str(i).encode())
            producer.flush()
            expected |= {(topic, i) for i in range(EVENTS_PER_START)}
            with log_path.open("a") as log:
                probe = subprocess.Popen([sys.executable, "-m", "tests.streams.recovery_probe", kafka_broker, prefix,
                                          *options], stdout=log, stderr=subprocess.STDOUT)
            try:
                wait_for(lambda: {(t, o) for t, o, _ in echoes(kafka_broker, f"{prefix}out")} >= expected,
                         timeout=120, what=f"start {start}: every event handled")
            finally:
                probe.terminate()
                assert probe.wait(timeout=60) == 0
            if start == 0:
                first_start_echoes = len(echoes(kafka_broker, f"{prefix}out"))
        restarted = echoes(kafka_broker, f"{prefix}out")[first_start_echoes:]
    finally:
        producer.close()
    # the restarted stage's table held the first start's values before it handled anything
    assert restarted and min(seen for _, _, seen in restarted) >= EVENTS_PER_START, restarted
    seeks = re.findall(r"seek flow_control=(\w+) fetching=(\w+)", log_path.read_text())
    assert len(seeks) >= 2, log_path.read_text()  # at least one per start
    assert set(seeks) == {("False", "False")}
