"""`rollstream replay` on the real broker: selection by predicate, offsets, time and key;
JSON lines; --follow; --to-topic re-injects the exact bytes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rollstream.kafka.clients import make_producer
from rollstream.schemas import encode
from rollstream.tools.readback import read_topic

from .test_trainer_consumer import group_record

pytestmark = pytest.mark.integration

BASE_MS = 1_795_000_000_000


def rejected(key: str, reason: str, domain: str) -> dict:
    record = group_record(key, n=2, accepted=False)
    record.update(reason=reason, domain=domain, decision_values={"std": 0.0})
    return record


def produce_rejections(bootstrap: str, topic: str) -> None:
    producer = make_producer(bootstrap)
    events = [(b"p0", encode(rejected("p0", "zero_std", "gsm8k"), "Group")),
              (b"p1", encode(rejected("p1", "mean_too_low", "gsm8k"), "Group")),
              (b"junk", b"not avro"),
              (b"p3", encode(rejected("p3", "zero_std", "arithmetic"), "Group")),
              (b"p4", encode(rejected("p4", "zero_std", "gsm8k"), "Group"))]
    for i, (key, value) in enumerate(events):
        producer.send(topic, key=key, value=value, partition=0, timestamp_ms=BASE_MS + 1000 * i)
    producer.flush()
    producer.close()


def cli(*args: str, timeout: float = 60) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "rollstream", "replay", *args], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def test_replay_selects_what_was_filtered_and_why(kafka_broker, topic_factory):
    topics = topic_factory(["groups.rejected", "groups.accepted"])
    produce_rejections(kafka_broker, topics.groups_rejected)
    common = ("-b", kafka_broker, "--prefix", topics.prefix)

    rows = cli("groups.rejected", *common, "-w", "reason=zero_std", "-w", "domain=gsm8k")
    assert [(r["offset"], r["key"], r["value"]["group_key"]) for r in rows] == [(0, "p0", "p0"), (4, "p4", "p4")]
    assert rows[0]["schema"] == "Group" and rows[0]["timestamp_ms"] == BASE_MS
    assert rows[0]["value"]["decision_values"] == {"std": 0.0}

    everything = cli(topics.groups_rejected, "-b", kafka_broker)  # a full topic name works too
    assert [r["offset"] for r in everything] == [0, 1, 2, 3, 4]
    assert everything[2]["schema"] is None and everything[2]["raw_b64"] == "bm90IGF2cm8="
    assert [r["offset"] for r in cli("groups.rejected", *common, "--from-offset", "1", "--to-offset", "4")] == [1, 2, 3]
    assert [r["offset"] for r in cli("groups.rejected", *common, "--since", str(BASE_MS + 1000),
                                     "--until", str(BASE_MS + 3000))] == [1, 2]
    assert [r["key"] for r in cli("groups.rejected", *common, "--key", "p3")] == ["p3"]

    # --to-topic: the selected records, same keys and bytes, into a sandbox topic
    cli("groups.rejected", *common, "-w", "reason=zero_std", "--to-topic", topics.groups_accepted)
    copied = list(read_topic(kafka_broker, topics.groups_accepted))
    originals = {r.offset: r for r in read_topic(kafka_broker, topics.groups_rejected)}
    assert [(c.key, c.raw) for c in copied] == [(originals[o].key, originals[o].raw) for o in (0, 3, 4)]


def test_replay_follow_reads_new_events_live(kafka_broker, topic_factory):
    topics = topic_factory(["groups.rejected"])
    proc = subprocess.Popen([sys.executable, "-m", "rollstream", "replay", "groups.rejected", "-b", kafka_broker,
                             "--prefix", topics.prefix, "--follow", "--limit", "2", "-w", "reason=zero_std"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        produce_rejections(kafka_broker, topics.groups_rejected)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert [json.loads(line)["key"] for line in out.splitlines()] == ["p0", "p3"]


def test_replay_rejects_bad_input_with_a_clear_error(kafka_broker, topic_factory):
    topic_factory(["groups.rejected"])  # under the t-... prefix; the default prefix's topic is created here:
    from rollstream.kafka.admin import create_topics
    from rollstream.kafka.topics import Topics

    create_topics(kafka_broker, {Topics().groups_rejected: (1, False)})
    for args, message in ((("groups.rejected", "-w", "reason"), "bad predicate"),
                          (("no.such.topic",), "does not exist"),
                          (("groups.rejected", "--since", "yesterday"), "ISO 8601"),
                          (("groups.rejected", "-f", "xml"), "jsonl or table"),
                          (("groups.rejected", "--limit", "0"), "--limit must be >= 1"),
                          (("groups.rejected", "-p", "9"), "has no partition [9]")):
        out = subprocess.run([sys.executable, "-m", "rollstream", "replay", *args, "-b", kafka_broker],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and message in " ".join(out.stderr.split()), out.stderr
    # a field no event has: zero records, and a hint why
    out = subprocess.run([sys.executable, "-m", "rollstream", "replay", "groups.rejected", "-b", kafka_broker,
                          "-w", "reasn=zero_std"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "0 records" in out.stderr
