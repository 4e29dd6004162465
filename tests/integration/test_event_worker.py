"""The plain workers' Kafka shell on the real broker: static partition split, dead letters."""

from __future__ import annotations

import pytest

from rollstream.kafka.context import StageContext
from rollstream.kafka.admin import create_topics
from rollstream.kafka.clients import make_producer
from rollstream.kafka.events import Send
from rollstream.kafka.event_worker import EventWorker
from rollstream.kafka.readback import count_records
from rollstream.tools.readback import read_topic, read_values

from .harness import produce, prompt

pytestmark = pytest.mark.integration


def test_instances_split_the_partitions_and_each_event_is_handled_once(kafka_broker, topic_factory):
    topics = topic_factory(["dead-letter"])
    source = topics.prompts
    create_topics(kafka_broker, {source: (4, False)})
    produce(kafka_broker, source, "Prompt", [prompt(f"p{i:02d}") for i in range(40)])
    producer = make_producer(kafka_broker)
    producer.send(source, key=b"p00", value=b"garbage")
    producer.flush()
    producer.close()

    handled: dict[int, list[str]] = {0: [], 1: []}
    workers = []
    for instance in (0, 1):
        worker = EventWorker(
            StageContext(kafka_broker, topics, "split", instance, 2), input_topic=source,
            group_id=f"{topics.prefix}split", expected_schema="Prompt",
            handler=lambda inputs, i=instance: handled[i].extend(x.record["prompt_id"] for x in inputs) or [],
        )
        workers.append(worker)
        worker.run(max_idle_s=3.0)

    assert [w.partitions for w in workers] == [[0, 2], [1, 3]]
    assert not set(handled[0]) & set(handled[1])
    assert sorted(handled[0] + handled[1]) == [f"p{i:02d}" for i in range(40)]
    [dead] = read_values(kafka_broker, topics.dead_letter)
    assert (dead["reason"], dead["payload"]) == ("undecodable", b"garbage")

    # offsets were committed: a restarted instance finds nothing left to do
    again = EventWorker(StageContext(kafka_broker, topics, "split", 0, 2), input_topic=source,
                        group_id=f"{topics.prefix}split", expected_schema="Prompt", handler=lambda inputs: [])
    again.run(max_idle_s=3.0)
    assert again.processed == 0


def test_an_output_above_max_message_bytes_is_dead_lettered_too_large_and_the_worker_goes_on(
        kafka_broker, topic_factory):
    topics = topic_factory(["prompts", "responses", "dead-letter"])
    produce(kafka_broker, topics.prompts, "Prompt", [prompt(f"p{i}") for i in range(4)])

    def handler(inputs):  # p1 asks for an event of 40 kB, above the 16 kB limit of this worker
        return [Send(topics.responses, x.record["prompt_id"],
                     b"x" * (40_000 if x.record["prompt_id"] == "p1" else 100)) for x in inputs]

    worker = EventWorker(StageContext(kafka_broker, topics, "big", max_message_bytes=16_384), input_topic=topics.prompts,
                         group_id=f"{topics.prefix}big", expected_schema="Prompt", handler=handler)
    worker.run(max_idle_s=3.0)
    assert (worker.processed, worker.too_large, worker.dead_lettered) == (4, 1, 1)
    assert sorted(len(r.raw) for r in read_topic(kafka_broker, topics.responses)) == [100] * 3
    [dead] = read_values(kafka_broker, topics.dead_letter)
    assert (dead["reason"], dead["source_topic"], dead["key"], dead["partition"], dead["offset"]) == (
        "too_large", topics.responses, b"p1", -1, -1)
    assert "40000 bytes, above kafka.max_message_bytes = 16384" in dead["error"]


def test_a_handlers_parts_are_handled_in_its_order_each_produced_before_the_next_then_committed(
        kafka_broker, topic_factory):
    topics = topic_factory(["prompts", "responses", "dead-letter"])
    produce(kafka_broker, topics.prompts, "Prompt", [prompt(f"p{i}", mode="val" if i % 2 else "train")
                                                     for i in range(6)])
    seen: list[tuple[list[str], int]] = []  # per call: its prompts, and the responses already on the topic

    class Handler:
        def parts(self, inputs):  # the train prompts first, as generation orders them
            return [[x for x in inputs if x.record["mode"] == "train"], [x for x in inputs if x.record["mode"] == "val"]]

        def __call__(self, inputs):
            seen.append(([x.record["prompt_id"] for x in inputs], count_records(kafka_broker, topics.responses)))
            return [Send(topics.responses, x.record["prompt_id"], b"r") for x in inputs]

    worker = EventWorker(StageContext(kafka_broker, topics, "parts"), input_topic=topics.prompts,
                         group_id=f"{topics.prefix}parts", expected_schema="Prompt", handler=Handler(), max_batch=2,
                         lookahead=3)
    worker.run(max_idle_s=3.0)
    # at most max_batch per call, one part (train or val) per call, each call finding every
    # earlier call's responses on the topic; in a poll of all six (the usual one: lookahead 3)
    # the train part came first, max_batch at a time
    assert [before for _, before in seen] == [sum(len(ids) for ids, _ in seen[:k]) for k in range(len(seen))]
    assert all(len({int(pid[1:]) % 2 for pid in ids}) == 1 and len(ids) <= 2 for ids, _ in seen)
    assert sorted(pid for ids, _ in seen for pid in ids) == [f"p{i}" for i in range(6)]
    # one partition, so a val prompt handled before a train prompt came from an earlier poll: it is
    # earlier on the topic, however the broker split the polls
    order = [int(pid[1:]) for ids, _ in seen for pid in ids]
    assert all(v < t for i, v in enumerate(order) if v % 2 for t in order[i + 1:] if t % 2 == 0)
    assert [x for x in order if x % 2 == 0] == [0, 2, 4] and [x for x in order if x % 2] == [1, 3, 5]
    again = EventWorker(StageContext(kafka_broker, topics, "parts"), input_topic=topics.prompts,
                        group_id=f"{topics.prefix}parts", expected_schema="Prompt", handler=lambda inputs: [])
    again.run(max_idle_s=3.0)
    assert again.processed == 0  # committed after the last part
