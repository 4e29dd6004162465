"""Periodic validation on the real broker (``eval_steps``): the admission generates the
validation prompts again at every eval_steps-th policy version, by the version that was current,
and the learning curve reads each round back. The synthetic rollout's reward depends on the
version that generated a response, so a round validated by the wrong version shows."""

from __future__ import annotations

import pytest

from rollstream.app.stages import Stage
from rollstream.policy.versions import PolicyVersionWatcher
from rollstream.tools.learning import validation_by_version
from rollstream.tools.readback import read_values
from rollstream.trainer.publisher import PolicyPublisher

from .harness import SyntheticRollout, produce, prompt, start_stages, wait_for, write_config

pytestmark = pytest.mark.integration


def test_validation_runs_at_every_eval_steps_versions_with_the_current_version(kafka_broker, topic_factory, tmp_path):
    topics = topic_factory(partitions=2)
    config = write_config(tmp_path, topics, 2, eval_steps=2, val_num_return_sequences=4, max_steps=10)
    watcher = PolicyVersionWatcher(kafka_broker, topics)
    version = lambda: watcher.latest_version() or 0  # noqa: E731  (read in the rollout's thread only)
    holder: dict[str, int] = {}

    def script(prompt_id: str, index: int, round_: int) -> tuple[float, str]:
        # a response of version v is right for the first v of its 4 samples: accuracy v / 4
        return float(index < holder["v"]), "stop"

    def stamped() -> int:
        holder["v"] = version()
        return holder["v"]

    stages = start_stages(config, kafka_broker, tmp_path / "logs", Stage.admission, Stage.aggregator)
    admission_log = tmp_path / "logs" / "admission.log"
    rollout = SyntheticRollout(kafka_broker, topics, script, policy_version=stamped)
    rollout.start()
    publisher = PolicyPublisher(kafka_broker, topics)

    def rounds() -> dict[int, dict]:
        return validation_by_version(read_values(kafka_broker, topics.groups_validation))

    def round_done(v: int) -> bool:
        return rounds().get(v, {}).get("groups") == 2

    try:
        produce(kafka_broker, topics.prompts, "Prompt", [prompt("v0", mode="val"), prompt("v1", mode="val"),
                                                         prompt("p0")])
        wait_for(lambda: round_done(0), what="the first validation round", stages=stages)
        for v in (1, 2, 3, 4):
            publisher.publish(v, v - 1, "", trained=False)
            if v % 2 == 0:
                wait_for(lambda: round_done(v), what=f"the validation round of version {v}", stages=stages)
            else:  # an odd version is not due a round: the admission says so once it has checked
                wait_for(lambda: f"policy version {v} is not due a validation round" in admission_log.read_text(),
                         what=f"the admission to check version {v}", stages=stages)
        assert sorted(rounds()) == [0, 2, 4]
        assert {v: (r["generated_by"], r["accuracy"], r["responses"]) for v, r in rounds().items()} == {
            0: ([0], 0.0, 8), 2: ([2], 0.5, 8), 4: ([4], 1.0, 8)}
        requested = sorted(r["prompt_id"] for r in rollout.requests if r["mode"] == "val")
        assert requested == ["v0", "v0#v2", "v0#v4", "v1", "v1#v2", "v1#v4"]  # each round once
    finally:
        rollout.stop()
        publisher.close()
        watcher.close()
        stages.close()


def test_a_round_comes_after_the_train_prompts_its_version_lets_in_and_takes_no_train_slot(
        kafka_broker, topic_factory, tmp_path):
    """The generation workers take requests in topic order: at a version that is due a round and
    lets the next step's prompts in, those train requests come first (the round would make that
    step's batch wait behind all its samples). The first round (the val prompts themselves, in
    the order of ``prompts``) holds no train slot: the train prompts after it go at once."""
    topics = topic_factory(partitions=1)  # one partition: the requests' order is the topic's
    config = write_config(tmp_path, topics, 1, eval_steps=1, max_staleness=0, rollout_batch_size=2,
                          max_running_prompts=2, num_return_sequences_in_group=2, val_num_return_sequences=1,
                          max_steps=3)
    produce(kafka_broker, topics.prompts, "Prompt", [prompt(f"v{k}", mode="val") for k in range(3)]
            + [prompt(f"p{k}") for k in range(6)])
    rollout = SyntheticRollout(kafka_broker, topics, lambda pid, index, round_: (float(index == 0), "stop"))
    rollout.start()
    stages = start_stages(config, kafka_broker, tmp_path / "logs", Stage.admission, Stage.aggregator)
    publisher = PolicyPublisher(kafka_broker, topics)

    def requested() -> list[str]:
        return [r["prompt_id"] for r in rollout.requests]

    try:
        # round 0, then step 0's two prompts; step 1 waits for version 1 (max_staleness 0)
        wait_for(lambda: len(requested()) >= 5, what="round 0 and step 0's prompts", stages=stages)
        assert requested() == ["v0", "v1", "v2", "p0", "p1"]
        publisher.publish(1, 0, "", trained=False)
        wait_for(lambda: all(f"v{k}#v1" in requested() for k in range(3)), what="round 1", stages=stages)
        order = requested()
        # step 1's prompts before round 1 (later steps' may come before or after it: the train
        # prompts keep their turn while the slots take them)
        assert max(order.index("p2"), order.index("p3")) < min(order.index(f"v{k}#v1") for k in range(3))
    finally:
        rollout.stop()
        publisher.close()
        stages.close()
