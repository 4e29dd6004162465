"""The trainer's agentic underfill verdict comes from GroupQueueOutcome events, and is the one the
group queue's metric records used to give (real broker, group queue processor in process)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rollstream.config import parse_config
from rollstream.kafka.clients import make_producer
from rollstream.schemas import encode
from rollstream.streams.group_queue_processor import GroupQueueProcessor
from rollstream.streams.store import MemoryStore
from rollstream.tools.readback import read_values
from rollstream.trainer.verdicts import AgenticBatchEvents
from tests.integration.harness import wait_for
from tests.streams.test_group_queue_processor import STD_FILTER, agentic_config, trajectory

pytestmark = pytest.mark.integration


def run_group_queues(topics) -> list:
    """Three train group ids through the processor; every send it makes, in order.

    0: accept, zero_std, accept -> complete (2 accepted); 1: refill_exhausted, zero_std, accept,
    zero_std -> exhausted (1 accepted); 2: three deadlines missed -> exhausted (0 accepted)."""
    raw = agentic_config(group_size=2, num_env_groups=3, group_filter_cls=STD_FILTER, max_replaced_episodes=2,
                         episode_timeout_s=1.0, max_reissues_per_episode=0, refill={"max_refills_per_group": 0})
    raw.update(kafka={"topic_prefix": topics.prefix, "partitions": 1}, rollout_batch_size=4, max_steps=2)
    config = parse_config(raw)
    proc = GroupQueueProcessor(config, MemoryStore())
    sends = []
    offsets: dict[str, int] = {}

    def feed(topic: str, record: dict, schema: str, now: int = 0) -> None:
        offset = offsets[topic] = offsets.get(topic, -1) + 1  # where the event would sit on its topic
        handled = proc.handle(topic, 0, encode(record, schema), now=now, offset=offset)
        assert handled.error is None, handled.error
        sends.extend(handled.sends)

    for gid in range(3):
        feed(topics.episodes_control, {"command": "start", "mode": "train", "group_id": gid}, "GroupCommand")
    episodes = {0: [(1.0, 0.0), (0.0, 0.0), (0.0, 1.0)],
                1: [None, (0.0, 0.0), (1.0, 0.0), (0.0, 0.0)]}  # None: an infra failure, no refill left
    for gid, rewards in episodes.items():
        for eid, pair in enumerate(rewards):
            if pair is None:
                feed(topics.trajectories, trajectory(gid, eid, 0, 0.0, env_failed=True), "Trajectory")
                continue
            for t, reward in enumerate(pair):
                feed(topics.trajectories, trajectory(gid, eid, t, reward), "Trajectory")
    for k in range(1, 4):  # group 2's runs never arrive
        sends.extend(proc.tick({0}, now=k * 10**13).sends)
    return config, sends


def verdict_from_metrics(metrics: list[dict], num_groups: int, target: int, builder) -> list[dict]:
    """What AgenticBatchEvents computed before GroupQueueOutcome existed: group_queue/done and
    group_queue/groups metric records of mode train."""
    done, rejected, episodes = {}, {}, 0
    for record in metrics:
        if record["labels"].get("mode") != "train":
            continue
        if record["name"] == "group_queue/done":
            done[record["labels"]["group_id"]] = record["value"]
        elif record["name"] == "group_queue/groups":
            episodes += 1
            reason = record["labels"].get("reason", "")
            if reason != "accepted":
                rejected[reason] = rejected.get(reason, 0) + 1
    if len(done) < num_groups:
        return []
    remaining = int(sum(done.values())) - builder.committed_groups - builder.dropped_groups
    if remaining >= target:
        return []
    return [{"step": builder.step, "status": "underfilled", "target_groups": target, "accepted_groups": remaining,
             "prompts_consumed": episodes, "rejected_by_reason": rejected}]


def test_underfill_verdict_from_outcome_events_equals_the_metric_derived_one(kafka_broker, topic_factory):
    topics = topic_factory(["episodes.outcomes", "metrics"])
    config, sends = run_group_queues(topics)
    producer = make_producer(kafka_broker)
    for send in sends:
        if send.topic in (topics.episodes_outcomes, topics.metrics):
            producer.send(send.topic, key=send.key.encode(), value=send.value)
    producer.flush()
    producer.close()
    outcomes = read_values(kafka_broker, topics.episodes_outcomes)
    assert sorted((o["group_id"], o["status"], o["accepted"]) for o in outcomes) == [
        (0, "complete", 2), (1, "exhausted", 1), (2, "exhausted", 0)]
    metrics = read_values(kafka_broker, topics.metrics)

    # 3 accepted in all; a batch is 2 groups; dropped: stale or payload_expired before a batch
    for committed, dropped in ((0, 0), (2, 0), (1, 1), (0, 2), (3, 0)):
        builder = SimpleNamespace(step=committed, committed_groups=committed, dropped_groups=dropped)
        expected = verdict_from_metrics(metrics, 3, config.groups_per_batch, builder)
        events = AgenticBatchEvents(kafka_broker, topics, config, builder)
        got: list[dict] = []

        def read_all() -> bool:
            got.extend(events.verdicts())  # the call that reads the last outcome gives the verdict
            return len(events.done) == 3

        try:
            wait_for(read_all, timeout=30, what="three outcomes read")
            assert got == expected
            assert events.verdicts() == []  # one verdict per step
        finally:
            events.close()
    assert expected == [{"step": 3, "status": "underfilled", "target_groups": 2, "accepted_groups": 0,
                         "prompts_consumed": 10,
                         "rejected_by_reason": {"zero_std": 3, "refill_exhausted": 1, "episode_timeout": 3}}]
