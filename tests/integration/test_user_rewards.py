"""User reward functions by import path through the real reward worker (`rollstream worker reward
--concurrency 2`, its process pool) and the real aggregator, on the real broker: a function that
hangs, raises or returns NaN costs only its own responses, each with its exact reason, and every
prompt is still decided."""

from __future__ import annotations

import pytest

from rollstream.app.stages import Stage
from rollstream.tools.readback import read_values

from .harness import produce, response_payload, start_stages, wait_for, write_config

pytestmark = pytest.mark.integration

USER = "tests.workers.user_rewards"
TIMEOUT_S = 1.0

# prompt -> (domain, its two replies); ground truth "1"
PROMPTS = {
    "e1": ("exact", ["1", "1"]),
    "s1": ("sleep", ["1", "1"]),
    "r1": ("raise", ["1", "1"]),
    "n1": ("nan", ["1", "1"]),
    "e2": ("exact", ["1", "2"]),
}


def test_failing_reward_functions_reject_only_their_responses(kafka_broker, topic_factory, tmp_path):
    topics = topic_factory(partitions=1)  # one partition: the responses are neighbours in the worker's polls
    rewards = {
        "exact": {"reward_type": f"{USER}:exact_match", "query_filter_config": {"type": "no_filter", "metric": "acc"}},
        "sleep": {"reward_type": f"{USER}:sleeps", "reward_timeout_s": TIMEOUT_S},
        "raise": {"reward_type": f"{USER}:raises"},
        "nan": {"reward_type": f"{USER}:returns_nan"},
    }
    config = write_config(tmp_path, topics, 1, rewards=rewards, num_return_sequences_in_group=2, max_response_rounds=1)
    stages = start_stages(config, kafka_broker, tmp_path / "logs", Stage.aggregator)
    stages.start(Stage.reward, "--concurrency", "2")
    try:
        # interleaved: every failing response sits between responses that score normally
        records = []
        for index in range(2):
            for pid, (domain, replies) in PROMPTS.items():
                records.append({**response_payload(pid, index, domain=domain), "response_text": replies[index]})
        produce(kafka_broker, topics.responses, "Response", records)
        wait_for(lambda: len(read_values(kafka_broker, topics.prompt_outcomes)) == len(PROMPTS),
                 what="every prompt decided", stages=stages)

        outcomes = {o["prompt_id"]: (o["outcome"], o["reason"]) for o in read_values(kafka_broker, topics.prompt_outcomes)}
        assert outcomes == {
            "e1": ("commit", "accepted"), "e2": ("commit", "accepted"),
            "s1": ("abort", "response_retries_exhausted"), "r1": ("abort", "response_retries_exhausted"),
            "n1": ("abort", "response_retries_exhausted"),
        }
        rewarded = {(r["response"]["prompt_id"], r["response"]["sample_index"]): r
                    for r in read_values(kafka_broker, topics.responses_rewarded)}
        assert len(rewarded) == 2 * len(PROMPTS)
        failures = {key: (r["meta"].get("reward_failure"), r["reward_error"]) for key, r in rewarded.items()}
        assert failures == {
            ("e1", 0): (None, None), ("e1", 1): (None, None), ("e2", 0): (None, None), ("e2", 1): (None, None),
            ("s1", 0): ("reward_timeout", "no result within reward_timeout_s=1"),
            ("s1", 1): ("reward_timeout", "no result within reward_timeout_s=1"),
            ("r1", 0): ("reward_error", "ValueError: cannot score '1'"),
            ("r1", 1): ("reward_error", "ValueError: cannot score '1'"),
            ("n1", 0): ("invalid_reward", "returned score nan"), ("n1", 1): ("invalid_reward", "returned score nan"),
        }

        accepted = {g["prompt_id"]: g for g in read_values(kafka_broker, topics.groups_accepted)}
        assert sorted(accepted) == ["e1", "e2"]
        assert [r["response_level_reward"] for r in accepted["e2"]["responses"]] == [1.0, 0.0]
        assert [r["scores"]["acc"] for r in accepted["e1"]["responses"]] == [1.0, 1.0]
        rejected = {g["prompt_id"]: {k: v for k, v in g["decision_values"].items() if k.startswith("rejected_responses/")}
                    for g in read_values(kafka_broker, topics.groups_rejected)}
        assert rejected == {
            "s1": {"rejected_responses/reward_timeout": 2.0},
            "r1": {"rejected_responses/reward_error": 2.0},
            "n1": {"rejected_responses/invalid_reward": 2.0},
        }
        stages.check()  # both stages are still alive
    finally:
        stages.close()
