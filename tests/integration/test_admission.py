"""Admission + aggregation on the real broker, with a synthetic rollout source (no model)."""

from __future__ import annotations

import pytest

from rollstream.app.stages import Stage
from rollstream.kafka.topics import Topics
from rollstream.tools.readback import read_values

from .harness import SyntheticRollout, produce, prompt, start_stages, wait_for, write_config

pytestmark = pytest.mark.integration
PARTITIONS = 2


def pipeline(kafka_broker, topics: Topics, tmp_path, script, **overrides):
    config = write_config(tmp_path, topics, PARTITIONS, **overrides)
    stages = start_stages(config, kafka_broker, tmp_path / "logs", Stage.admission, Stage.aggregator)
    rollout = SyntheticRollout(kafka_broker, topics, script)
    rollout.start()
    return stages, rollout


def rewards_by_prompt(table):
    """Script: prompt id -> four rewards; anything else all zeros."""
    return lambda pid, index, round_: (table.get(pid, [0.0] * 64)[index], "stop")


def test_rejected_prompt_frees_its_slot_and_a_new_prompt_is_admitted(kafka_broker, topic_factory, tmp_path):
    topics = topic_factory(partitions=PARTITIONS)
    script = rewards_by_prompt({"p0": [1, 0, 0, 0], "p2": [0, 1, 0, 0]})
    stages, rollout = pipeline(kafka_broker, topics, tmp_path, script, rollout_batch_size=2,
                               max_running_prompts=2, max_prompts_per_batch=10)
    try:
        produce(kafka_broker, topics.prompts, "Prompt", [prompt(f"p{i}") for i in range(6)])
        wait_for(lambda: len(read_values(kafka_broker, topics.groups_accepted)) == 2, timeout=180, what="2 groups", stages=stages)
        first_round = sorted(r["prompt_id"] for r in rollout.requests if r["round"] == 0)
        # p0 accepted, p1 rejected -> exactly one more prompt (p2) -> batch of 2 is full: no p3
        assert first_round == ["p0", "p1", "p2"]
        [rejected] = read_values(kafka_broker, topics.groups_rejected)
        assert (rejected["prompt_id"], rejected["reason"]) == ("p1", "zero_std")
        assert all(r["num_return_sequences"] == 4 for r in rollout.requests)
        # decided groups name their responses' payloads by reference, never carry the tokens
        rows = [r for g in read_values(kafka_broker, topics.groups_accepted) for r in g["responses"]]
        assert len(rows) == 8 and all(r["payload"]["topic"] == topics.responses for r in rows)
        assert all(r["response"]["response_length"] == 4 for r in rows)
    finally:
        rollout.stop()
        stages.close()


def test_budget_ends_a_hopeless_batch_with_batch_underfilled(kafka_broker, topic_factory, tmp_path):
    # G=4, batch 4, budget 24 prompts, only two prompts ever give [1,0,0,0]
    topics = topic_factory(partitions=PARTITIONS)
    script = rewards_by_prompt({"p05": [1, 0, 0, 0], "p17": [1, 0, 0, 0]})
    stages, rollout = pipeline(kafka_broker, topics, tmp_path, script, rollout_batch_size=4,
                               max_running_prompts=8, max_prompts_per_batch=24)
    try:
        produce(kafka_broker, topics.prompts, "Prompt", [prompt(f"p{i:02d}") for i in range(40)])
        wait_for(lambda: read_values(kafka_broker, topics.batches), timeout=180, what="batch event", stages=stages)
        [event] = read_values(kafka_broker, topics.batches)
        assert (event["status"], event["step"], event["accepted_groups"], event["target_groups"],
                event["prompts_consumed"]) == ("underfilled", 0, 2, 4, 24)
        assert event["rejected_by_reason"] == {"zero_std": 22}
        assert len(rollout.requests) == 24  # never a 25th generation request
        assert sorted(g["prompt_id"] for g in read_values(kafka_broker, topics.groups_accepted)) == ["p05", "p17"]
    finally:
        rollout.stop()
        stages.close()


def test_too_long_prompt_is_rejected_with_reason_before_generation(kafka_broker, topic_factory, tmp_path):
    topics = topic_factory(partitions=PARTITIONS)
    script = rewards_by_prompt({"short": [1, 0, 0, 0]})
    stages, rollout = pipeline(kafka_broker, topics, tmp_path, script, rollout_batch_size=1, prompt_length=40)
    try:
        produce(kafka_broker, topics.prompts, "Prompt", [
            prompt("long", text="word " * 200), prompt("short"), {**prompt("val0", mode="val")},
        ])
        wait_for(lambda: read_values(kafka_broker, topics.groups_accepted), timeout=180, what="short accepted", stages=stages)
        wait_for(lambda: read_values(kafka_broker, topics.groups_validation), timeout=180, what="validation group", stages=stages)
        [rejected] = read_values(kafka_broker, topics.groups_rejected)
        assert (rejected["prompt_id"], rejected["reason"], rejected["rounds"]) == ("long", "prompt_too_long", 0)
        assert rejected["decision_values"]["prompt_length"] == 40.0
        assert rejected["decision_values"]["prompt_tokens"] > 200
        assert "long" not in {r["prompt_id"] for r in rollout.requests}
        [val] = read_values(kafka_broker, topics.groups_validation)
        assert (val["prompt_id"], val["accepted"], len(val["responses"])) == ("val0", True, 1)
    finally:
        rollout.stop()
        stages.close()
