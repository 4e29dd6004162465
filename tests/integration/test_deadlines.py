"""No unbounded wait, on the real broker: a prompt whose responses never come back is reissued,
then aborted ``prompt_timeout``, its credit returns and the run ends; a trainer that gets no
group and no verdict ends ``timed_out`` after ``batch_timeout_s``."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from rollstream.app.stages import Stage
from rollstream.config import load_config
from rollstream.streams.event_builders import derive_seed
from rollstream.tools.readback import read_values

from .harness import SyntheticRollout, commit_every_batch, produce, prompt, start_stages, wait_for, write_config
from .test_end_of_data import end_data, first_sample_passes, verdicts
from .test_trainer_consumer import produce as produce_groups
from .test_trainer_loop import accepted_group

pytestmark = pytest.mark.integration


def test_a_prompt_whose_responses_are_lost_is_reissued_then_aborted_and_the_run_ends(
        kafka_broker, topic_factory, tmp_path):
    topics = topic_factory(partitions=2)
    config = write_config(tmp_path, topics, 2, rollout_batch_size=4, max_running_prompts=2, max_steps=5,
                          prompt_timeout_s=3, max_reissues_per_prompt=2)

    def script(prompt_id: str, index: int, round_: int):
        if prompt_id == "p1" and index > 0:  # p1's first sample arrives, the others are lost
            return None
        return first_sample_passes(prompt_id, index, round_)

    stages = start_stages(config, kafka_broker, tmp_path / "logs", Stage.admission, Stage.aggregator)
    rollout = SyntheticRollout(kafka_broker, topics, script)
    rollout.start()
    try:
        produce(kafka_broker, topics.prompts, "Prompt", [prompt(f"p{i}") for i in range(3)])
        end_data(kafka_broker, topics, 3)
        wait_for(lambda: verdicts(kafka_broker, topics), timeout=180, what="the end-of-data verdict", stages=stages)
    finally:
        rollout.stop()
        stages.close()
    seed = load_config(config).seed
    requests = Counter((r["prompt_id"], r["round"], r["seed"], r["sample_offset"], r["num_return_sequences"])
                       for r in rollout.requests)
    assert requests == {("p0", 0, derive_seed(seed, "p0", 0), 0, 4): 1, ("p2", 0, derive_seed(seed, "p2", 0), 0, 4): 1,
                        ("p1", 0, derive_seed(seed, "p1", 0), 0, 4): 3}  # p1: its request and 2 identical reissues
    [rejected] = read_values(kafka_broker, topics.groups_rejected)
    assert (rejected["prompt_id"], rejected["reason"], rejected["decision_values"]) == (
        "p1", "prompt_timeout", {"reissues": 2.0, "missing": 3.0, "accepted": 1.0, "rounds": 1.0})
    outcomes = {o["prompt_id"]: (o["outcome"], o["reason"]) for o in read_values(kafka_broker, topics.prompt_outcomes)}
    assert outcomes == {"p0": ("commit", "accepted"), "p1": ("abort", "prompt_timeout"), "p2": ("commit", "accepted")}
    [verdict] = verdicts(kafka_broker, topics)
    assert (verdict["status"], verdict["accepted_groups"], verdict["rejected_by_reason"]) == (
        "end_of_data", 2, {"prompt_timeout": 1})


def test_a_trainer_without_groups_or_verdicts_ends_timed_out_after_batch_timeout_s(kafka_broker, topic_factory,
                                                                                    tmp_path):
    topics = topic_factory()
    produce_groups(kafka_broker, topics, [accepted_group("a"), accepted_group("b")])  # 2 of the 4 a batch needs
    started = time.monotonic()
    result = commit_every_batch(kafka_broker, topics, tmp_path, 4, 3, min_fill_ratio=1.0, batch_timeout_s=4)
    assert (result.outcome, result.steps) == ("timed_out", 0)
    assert result.detail == "no accepted group and no verdict for 4 s (batch_timeout_s) with 2 of 4 groups of step 0"
    assert time.monotonic() - started < 60
