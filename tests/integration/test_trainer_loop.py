"""The underfilled-batch policy end to end on the real broker (peer scenario 1)."""

from __future__ import annotations

import pytest

from rollstream.schemas.records import batch_event
from rollstream.streams.events import group_record
from rollstream.trainer.consumer import BatchBuilder
from rollstream.trainer.driver import build_batches
from rollstream.trainer.verdicts import BatchEvents, underfill_action

from .harness import produce, response

pytestmark = pytest.mark.integration


def accepted_group(pid: str) -> dict:
    responses = [response(pid, i, reward=float(i == 0)) for i in range(4)]
    return group_record(prompt=responses[0]["response"], decided_accepted=True, reason="accepted",
                        values={"std": 0.5}, responses=responses, filter_config="{}", filter_config_hash="h",
                        policy_version=0, rounds=1, responses_generated=4, prompt_token_ids=[1, 2, 3])


def setup(kafka_broker, topics):
    produce(kafka_broker, topics.groups_accepted, "Group", [accepted_group("p05"), accepted_group("p17")], "group_key")
    event = batch_event(step=0, status="underfilled", target=4, accepted=2, prompts_consumed=24,
                        rejected_by_reason={"zero_std": 22})
    produce(kafka_broker, topics.batches, "Batch", [event], "status")


def test_underfill_action_thresholds():
    assert underfill_action(2, 4, 0.5) == "ship_partial"
    assert underfill_action(2, 4, 0.75) == "fail"
    assert underfill_action(0, 4, 0.0 + 1e-9) == "fail"


def test_underfilled_batch_ships_partial_when_min_fill_ratio_allows(kafka_broker, topic_factory, tmp_path):
    topics = topic_factory()
    setup(kafka_broker, topics)
    builder = BatchBuilder(kafka_broker, topics, 4, group_id=f"{topics.prefix}trainer", manifest_path=tmp_path / "m.jsonl")
    events = BatchEvents(kafka_broker, topics)
    try:
        result = build_batches(builder, events, max_steps=1, min_fill_ratio=0.5)
    finally:
        events.close()
        builder.close()
    assert result.outcome == "complete"
    [entry] = result.batches
    assert (entry["status"], entry["accepted_groups"], entry["target_groups"]) == ("partial", 2, 4)
    assert sorted(entry["group_keys"]) == ["p05", "p17"]


def test_underfilled_batch_below_min_fill_ratio_fails_fast_and_keeps_the_groups(kafka_broker, topic_factory, tmp_path):
    topics = topic_factory()
    setup(kafka_broker, topics)
    group_id = f"{topics.prefix}trainer"
    builder = BatchBuilder(kafka_broker, topics, 4, group_id=group_id, manifest_path=tmp_path / "m.jsonl")
    events = BatchEvents(kafka_broker, topics)
    try:
        result = build_batches(builder, events, max_steps=1, min_fill_ratio=0.75)
    finally:
        events.close()
        builder.close()
    assert (result.outcome, result.batches) == ("batch_underfilled", [])
    assert "2/4 groups after 24 prompts" in result.detail and "zero_std" in result.detail
    # nothing was committed: a later trainer with the same group id still gets both groups
    again = BatchBuilder(kafka_broker, topics, 2, group_id=group_id, manifest_path=tmp_path / "m2.jsonl")
    try:
        batch = again.next_batch(timeout_s=30)
    finally:
        again.close()
    assert sorted(batch.group_keys) == ["p05", "p17"]
