"""The underfilled-batch policy end to end on the real broker."""

from __future__ import annotations

import pytest

from rollstream.kafka.clients import make_producer
from rollstream.schemas import encode
from rollstream.schemas.records import batch_event
from rollstream.trainer.batch_builder import BatchBuilder
from rollstream.trainer.verdicts import underfill_action

from ..trainer import records
from .harness import commit_every_batch
from .test_trainer_consumer import produce

pytestmark = pytest.mark.integration


def accepted_group(pid: str) -> dict:
    """An accepted Group of 4 responses (sample 0 rewarded 1), payloads written by ``produce``."""
    responses = [records.rewarded(records.response_payload(pid, i, [1, 2, 3], list(range(10, 14)), [-0.25] * 4),
                                  float(i == 0)) for i in range(4)]
    group = records.rlvr_group(pid, responses)
    group["decision_values"] = {"std": 0.5}
    return group


def setup(kafka_broker, topics):
    produce(kafka_broker, topics, [accepted_group("p05"), accepted_group("p17")])
    event = batch_event(step=0, status="underfilled", target=4, accepted=2, prompts_consumed=24,
                        rejected_by_reason={"zero_std": 22})
    producer = make_producer(kafka_broker)
    try:
        producer.send(topics.batches, key=b"0", value=encode(event, "Batch"))
        producer.flush()
    finally:
        producer.close()


def test_underfill_action_thresholds():
    assert underfill_action(2, 4, 0.5) == "ship_partial"
    assert underfill_action(2, 4, 0.75) == "fail"
    assert underfill_action(0, 4, 0.0 + 1e-9) == "fail"


def test_underfilled_batch_ships_partial_when_min_fill_ratio_allows(kafka_broker, topic_factory, tmp_path):
    topics = topic_factory()
    setup(kafka_broker, topics)
    result = commit_every_batch(kafka_broker, topics, tmp_path, 4, 1, min_fill_ratio=0.5)
    assert result.outcome == "complete"
    assert result.steps == 1
    entry = result.last
    assert (entry["status"], entry["accepted_groups"], entry["target_groups"]) == ("partial", 2, 4)
    assert sorted(entry["group_keys"]) == ["p05", "p17"]


def test_underfilled_batch_below_min_fill_ratio_fails_fast_and_keeps_the_groups(kafka_broker, topic_factory, tmp_path):
    topics = topic_factory()
    setup(kafka_broker, topics)
    group_id = f"{topics.prefix}trainer"
    result = commit_every_batch(kafka_broker, topics, tmp_path, 4, 1, min_fill_ratio=0.75)
    assert (result.outcome, result.steps) == ("batch_underfilled", 0)
    assert "2/4 groups after 24 prompts" in result.detail and "zero_std" in result.detail
    # nothing was committed: a later trainer with the same group id still gets both groups
    again = BatchBuilder(kafka_broker, topics, 2, group_id=group_id, manifest_path=tmp_path / "m2.jsonl")
    try:
        batch = again.next_batch(timeout_s=30)
    finally:
        again.close()
    assert sorted(batch.group_keys) == ["p05", "p17"]
